"""Which cloud this machine runs on, from local DMI evidence only, and which clouds to poll for notices.

``detect_cloud`` reads a few SMBIOS strings the kernel exposes under ``/sys/class/dmi/id`` and decides as
cloud-init's datasources do (``DataSourceEc2``, ``DataSourceGCE``, ``DataSourceAzure``). It never opens a
socket: asking a metadata address whether it exists would cost a connect timeout on every machine that is
not that cloud. The decision (``cloud_from_dmi``) is pure over the strings read; the only I/O is one
bounded read per file, which never blocks (a FIFO or device planted under the directory is refused by
``fstat``, opened non-blocking so the open itself cannot hang). A missing or unreadable file is no
evidence, not an error: most machines have no DMI directory at all. ``resolve_clouds`` turns the user's
option (``"auto"``, a name, a list of names, or ``None``) into the tuple the poller takes, validated once.
"""

from __future__ import annotations

import os
import stat
from typing import Mapping, Optional, Sequence, Union

CLOUDS = ("aws", "gcp", "azure")
"""Every cloud whose preemption notices lightning-resume understands."""

DMI_DIR = "/sys/class/dmi/id"

AZURE_CHASSIS_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
"""The chassis asset tag every Azure VM reports (cloud-init's ``DataSourceAzure`` checks the same string)."""

DMI_FIELDS = ("sys_vendor", "bios_vendor", "product_name", "product_version", "board_asset_tag", "chassis_asset_tag")
"""The files read. All are world-readable in sysfs (unlike ``product_serial`` or ``product_uuid``)."""

_READ_LIMIT = 256
"""DMI strings are at most 64 bytes in practice; sysfs reports every file as 4096 bytes, so the size says nothing."""

CloudSpec = Union[str, Sequence[str], None]


def read_dmi_field(dmi_dir: str, name: str) -> str:
    """The stripped text of ``dmi_dir/name``, or ``""`` when it is missing, unreadable or not a regular file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(os.path.join(dmi_dir, name), flags)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        data = os.read(fd, _READ_LIMIT)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace").strip()


def read_dmi(dmi_dir: str = DMI_DIR) -> dict[str, str]:
    """Every field of ``DMI_FIELDS`` as read by ``read_dmi_field`` (``""`` for no evidence)."""
    return {name: read_dmi_field(dmi_dir, name) for name in DMI_FIELDS}


def _is_aws(dmi: Mapping[str, str]) -> bool:
    sys_vendor, bios_vendor = dmi.get("sys_vendor", ""), dmi.get("bios_vendor", "")
    amazon_vendor = sys_vendor.lower().startswith("amazon") or bios_vendor.lower().startswith("amazon")
    return (
        sys_vendor == "Amazon EC2"
        or bios_vendor.startswith("Amazon")
        # Xen-era instances (m4, c4...) report the Xen vendor but "4.11.amazon" as the product version.
        or "amazon" in dmi.get("product_version", "").lower()
        or (dmi.get("board_asset_tag", "").startswith("i-") and amazon_vendor)
    )


def _is_gcp(dmi: Mapping[str, str]) -> bool:
    return dmi.get("product_name", "") == "Google Compute Engine" or dmi.get("sys_vendor", "") == "Google"


def _is_azure(dmi: Mapping[str, str]) -> bool:
    return dmi.get("chassis_asset_tag", "") == AZURE_CHASSIS_ASSET_TAG


def cloud_from_dmi(dmi: Mapping[str, str]) -> Optional[str]:
    """``"aws"``, ``"gcp"``, ``"azure"`` or ``None`` for these DMI strings (missing keys are no evidence).

    The checks are exclusive on real machines; should two match, the first of ``CLOUDS`` wins.
    """
    for name, matches in (("aws", _is_aws), ("gcp", _is_gcp), ("azure", _is_azure)):
        if matches(dmi):
            return name
    return None


def detect_cloud(dmi_dir: str = DMI_DIR) -> Optional[str]:
    """The cloud this machine runs on according to ``dmi_dir``, or ``None``. Opens no socket."""
    return cloud_from_dmi(read_dmi(dmi_dir))


def validate_clouds(names: Sequence[str], also: str = "") -> tuple[str, ...]:
    """``names`` without repeats, in order; ``ValueError`` naming every unknown one and the valid ones
    (``also``: the other values the caller's option takes, for the message)."""
    bad = [n for n in names if n not in CLOUDS]
    if bad:
        raise ValueError(f"clouds={list(names)!r}: unknown {bad!r}; choose from {list(CLOUDS)!r}{also}")
    return tuple(dict.fromkeys(names))


def resolve_clouds(spec: CloudSpec, dmi_dir: str = DMI_DIR) -> tuple[str, ...]:
    """The clouds to poll for the option ``spec``.

    ``"auto"``: the cloud ``detect_cloud`` finds, or ``()`` off the cloud (no socket is opened to find out).
    One name from ``CLOUDS`` (``"aws"``, as a YAML scalar reads), or a list or tuple of them: those, validated.
    ``None``: ``()``, polling off. ``ValueError`` names every unknown name and the valid ones.
    """
    if spec is None:
        return ()
    if spec == "auto":
        found = detect_cloud(dmi_dir)
        return (found,) if found is not None else ()
    return validate_clouds([spec] if isinstance(spec, str) else list(spec), also=", 'auto' or None")
