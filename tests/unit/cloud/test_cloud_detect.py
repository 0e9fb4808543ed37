"""Which cloud a machine is, from fake DMI directories; which clouds an option resolves to."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_resume.cloud import detect_cloud, resolve_clouds
from lightning_resume.cloud.detect import AZURE_CHASSIS_ASSET_TAG, CLOUDS, DMI_FIELDS, cloud_from_dmi, read_dmi_field
from lightning_resume.cloud.protocols import APIS


def _dmi(tmp_path, **fields: str) -> str:
    d = tmp_path / "dmi"
    d.mkdir(exist_ok=True)
    for name, value in fields.items():
        (d / name).write_text(value + "\n")  # sysfs ends each value with a newline
    return str(d)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"sys_vendor": "Amazon EC2", "product_name": "m5.large"}, "aws"),
        ({"sys_vendor": "Xen", "bios_vendor": "Amazon EC2"}, "aws"),
        ({"sys_vendor": "Xen", "bios_vendor": "Xen", "product_version": "4.11.amazon"}, "aws"),
        ({"sys_vendor": "Amazon.com", "board_asset_tag": "i-0123456789abcdef0"}, "aws"),
        ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, "gcp"),
        ({"product_name": "Google Compute Engine"}, "gcp"),
        ({"sys_vendor": "Google"}, "gcp"),
        ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": AZURE_CHASSIS_ASSET_TAG}, "azure"),
        ({"sys_vendor": "Dell Inc.", "product_name": "PowerEdge R750", "chassis_asset_tag": "12345"}, None),
        ({"sys_vendor": "QEMU", "board_asset_tag": "i-not-amazon"}, None),
        ({"sys_vendor": "Microsoft Corporation", "chassis_asset_tag": "7783-7084"}, None),
    ],
)
def test_each_cloud_is_recognised_from_its_dmi_strings(tmp_path, fields, expected):
    assert detect_cloud(_dmi(tmp_path, **fields)) == expected


def test_no_dmi_directory_or_an_empty_one_is_no_cloud(tmp_path):
    assert detect_cloud(str(tmp_path / "absent")) is None
    assert detect_cloud(_dmi(tmp_path)) is None


def _detect_in_thread(dmi_dir: str) -> list:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(detect_cloud(dmi_dir)), daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "detect_cloud blocked on a FIFO"
    return result


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_planted_as_sys_vendor_is_no_evidence_and_does_not_hang(tmp_path):
    dmi = _dmi(tmp_path, product_name="Google Compute Engine")
    os.mkfifo(os.path.join(dmi, "sys_vendor"))
    assert _detect_in_thread(dmi) == ["gcp"]  # the other files are still read
    os.remove(os.path.join(dmi, "product_name"))
    assert _detect_in_thread(dmi) == [None]


def test_a_directory_or_an_unreadable_file_is_no_evidence(tmp_path):
    dmi = _dmi(tmp_path, chassis_asset_tag=AZURE_CHASSIS_ASSET_TAG)
    os.mkdir(os.path.join(dmi, "sys_vendor"))
    assert read_dmi_field(dmi, "sys_vendor") == ""
    assert detect_cloud(dmi) == "azure"


def test_a_huge_file_is_read_only_in_its_first_bytes(tmp_path):
    dmi = _dmi(tmp_path)
    with open(os.path.join(dmi, "sys_vendor"), "w") as f:
        f.write("x" * (4 << 20))
    assert read_dmi_field(dmi, "sys_vendor") == "x" * 256


@given(st.dictionaries(st.sampled_from(DMI_FIELDS), st.text(max_size=40)))
def test_any_dmi_strings_give_a_known_cloud_or_none_and_amazon_ec2_is_aws(fields):
    assert cloud_from_dmi(fields) in (*CLOUDS, None)
    assert cloud_from_dmi({**fields, "sys_vendor": "Amazon EC2"}) == "aws"


# ------------------------------------------------------------------------------------ resolve_clouds


def test_auto_resolves_to_the_detected_cloud_or_to_none(tmp_path):
    assert resolve_clouds("auto", dmi_dir=_dmi(tmp_path, sys_vendor="Google")) == ("gcp",)
    assert resolve_clouds("auto", dmi_dir=str(tmp_path / "absent")) == ()


def test_names_are_validated_and_kept_in_order_without_repeats(tmp_path):
    assert resolve_clouds(["azure", "aws", "azure"], dmi_dir=str(tmp_path)) == ("azure", "aws")
    assert resolve_clouds(("gcp",)) == ("gcp",)
    assert resolve_clouds([]) == ()
    assert resolve_clouds(None) == ()


def test_unknown_names_are_refused_naming_them_and_the_valid_ones():
    with pytest.raises(ValueError) as info:
        resolve_clouds(["aws", "oracle", "GCP"])
    message = str(info.value)
    assert "'oracle'" in message and "'GCP'" in message and all(repr(c) in message for c in CLOUDS)


def test_one_name_is_one_cloud_not_a_string_of_letters():
    assert resolve_clouds("aws") == ("aws",)
    with pytest.raises(ValueError, match="'ec2'"):
        resolve_clouds("ec2")


def test_every_cloud_that_can_be_named_has_a_protocol():
    assert set(APIS) == set(CLOUDS)
