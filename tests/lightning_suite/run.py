"""Lightning's own tests, stock and with ``ExactResume()`` injected, compared test by test: one command.

    python tests/lightning_suite/run.py --source PATH [--ref TAG] [--dirs trainer loops ...] [-n 2]

Owns the harness: export Lightning's tests at a ref from a checkout or mirror the user points at
(nothing of Lightning's is kept in this repository), run pytest twice on each folder (stock, then with
``inject.py``), compare the junit files per test id, confirm the regressions by re-running them
away from the rest of the suite, and write the comparison to ``results/``. It does not change production code, and it is not
part of ``make test`` (no ``test_*.py`` file here). See docs/lightning-suite.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_DIRS = ("trainer", "loops", "callbacks", "checkpointing")
EXPORTED = ("tests/tests_pytorch", "tests/legacy", "pyproject.toml")  # pyproject: Lightning's pytest options
FAILED = ("failed", "error")
# Lightning's own options come from its pyproject.toml; these only make the output readable and comparable
SUITE = "lightning/tests/tests_pytorch"  # under the workdir; where Lightning's CI runs its tests from
PYTEST_OPTIONS = ("-p", "no:cacheprovider", "-p", "record", "-q", "--color=no", "-o", "junit_family=xunit1")
CODE = {"passed": "p", "failed": "f", "error": "e", "skipped": "s", None: "-"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--source",
        default=os.environ.get("LIGHTNING_SOURCE"),
        help="Lightning's repository: a git dir (bare or mirror), a work tree, or a plain copy of it",
    )
    p.add_argument(
        "--ref",
        help="tag or commit to export (default: the installed version's tag, else the newest "
        "tag of the same minor release below it)",
    )
    p.add_argument(
        "--dirs", nargs="+", default=list(DEFAULT_DIRS), help="folders (or test files) under tests/tests_pytorch"
    )
    p.add_argument(
        "--mode",
        choices=("both", "stock", "injected", "compare"),
        default="both",
        help="'compare' re-reads the junit files of an earlier run",
    )
    p.add_argument("-n", "--workers", default="0", help="pytest-xdist workers (0: none)")
    p.add_argument("--timeout", type=int, default=600, help="per-test timeout in seconds")
    p.add_argument("-k", dest="keyword", help="pytest -k expression, to run a subset")
    p.add_argument("--workdir", type=Path, help="export, junit and logs (default: a folder under the temp dir)")
    p.add_argument("--results", type=Path, help="comparison file (default: results/lightning-REF.json here)")
    p.add_argument("--fresh", action="store_true", help="export again even if the workdir has this ref")
    p.add_argument(
        "--confirm", choices=("file", "alone"), default="file", help="re-run regressions per file or each alone"
    )
    p.add_argument("--no-confirm", action="store_true", help="do not re-run each regression alone")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose Lightning is tested")
    return p.parse_args(argv)


# ---------------------------------------------------------------- export


def git_dir(source: Path) -> Path | None:
    """The git dir of ``source`` (itself for a bare repository or mirror), or None for a plain copy."""
    if (source / "HEAD").is_file() and (source / "objects").is_dir():
        return source
    out = subprocess.run(["git", "-C", str(source), "rev-parse", "--absolute-git-dir"], capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def installed_lightning(python: str) -> str:
    if python == sys.executable:
        return version("lightning")
    code = "from importlib.metadata import version; print(version('lightning'))"
    return subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _tags(gd: Path) -> list[str]:
    out = subprocess.run(["git", "--git-dir", str(gd), "tag", "-l"], check=True, capture_output=True, text=True)
    return out.stdout.split()


def _as_tuple(tag: str) -> tuple[int, ...] | None:
    return tuple(int(x) for x in tag.split(".")) if re.fullmatch(r"\d+(\.\d+)*", tag) else None


def resolve_ref(gd: Path, wanted: str | None, installed: str) -> tuple[str, str]:
    """The ref to export and a note saying why; an explicit ``--ref`` is taken as given."""
    if wanted:
        return wanted, "given with --ref"
    tags = _tags(gd)
    if installed in tags:
        return installed, "the installed version's tag"
    target = _as_tuple(installed)
    same_minor = [t for t in tags if (v := _as_tuple(t)) and target and v[:2] == target[:2] and v <= target]
    if not same_minor:
        sys.exit(
            f"no tag {installed} (the installed Lightning) in {gd}, nor an earlier {installed.rsplit('.', 1)[0]}"
            ".x tag: pass --ref, or update the source"
        )
    best = max(same_minor, key=_as_tuple)  # type: ignore[arg-type]
    return best, f"tag {installed} (installed) is not in the source; newest earlier tag of that minor release"


def export(source: Path, ref: str | None, dest: Path, installed: str) -> dict[str, str]:
    """Lightning's tests (and its pytest options) under ``dest``; returns what was exported from where."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    gd = git_dir(source)
    if gd is None:  # a plain copy: take it as it is
        for rel in EXPORTED:
            src = source / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel)
            elif src.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / rel)
        write_manifest(dest)
        return {"source": str(source), "ref": "work tree as it is", "ref_note": "not a git repository"}
    ref, note = resolve_ref(gd, ref, installed)
    commit = subprocess.run(
        ["git", "--git-dir", str(gd), "rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryFile() as tar:
        # a partial mirror may lack blobs outside the exported paths; git still exits 0 for these
        done = subprocess.run(
            ["git", "--git-dir", str(gd), "archive", "--format=tar", commit, *EXPORTED],
            stdout=tar,
            stderr=subprocess.PIPE,
        )
        if done.returncode != 0:
            sys.exit(f"git archive {commit} failed: {done.stderr.decode(errors='replace')}")
        tar.seek(0)
        with tarfile.open(fileobj=tar) as tf:
            tf.extractall(dest, filter="data")
    write_manifest(dest)
    if not (dest / "tests/tests_pytorch/conftest.py").is_file():
        sys.exit(f"{ref} of {gd} has no tests/tests_pytorch/conftest.py: not Lightning's repository?")
    return {"source": str(source), "ref": ref, "commit": commit, "ref_note": note}


MANIFEST = "exported-files.txt"  # beside the export, not in it


def write_manifest(dest: Path) -> None:
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    (dest.parent / MANIFEST).write_text("\n".join(files) + "\n")


def clean_export(dest: Path) -> None:
    """Remove what earlier runs left in the export (a test that writes into the working directory):
    Lightning's "left artifacts behind" check compares before and after each test, so a leftover
    would hide the same artifact in the next run."""
    manifest = dest.parent / MANIFEST
    if not manifest.exists():  # an export made before manifests: leave it as it is
        return
    keep = set(manifest.read_text().splitlines())
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = str(path.relative_to(dest))
        if "__pycache__" in path.parts or rel in keep:
            continue
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink()


# ---------------------------------------------------------------- runs


def pytest_command(args: argparse.Namespace, targets: list[str], junit: Path, injected: bool) -> list[str]:
    cmd = [args.python, "-m", "pytest", *targets, *PYTEST_OPTIONS, f"--timeout={args.timeout}", f"--junitxml={junit}"]
    return cmd + ["-p", "inject"] if injected else cmd


def environment(warnings_file: Path) -> dict[str, str]:
    """Both runs get the same environment: this directory (the plugins) and this repository (the
    package under test) on PYTHONPATH, one OpenMP thread (the machine is shared)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["LSUITE_WARNINGS_FILE"] = str(warnings_file)
    return env


def run_name(mode: str, folder: str) -> str:
    """The name of one run's junit, log and warnings files: a folder, or a file under it
    (``core/test_lightning_optimizer.py``), with the mode."""
    return f"{mode}-{folder.replace('/', '--')}"


def run_mode(args: argparse.Namespace, mode: str, folder: str, workdir: Path) -> int:
    """One pytest process for one folder in one mode; its junit, log and warnings are named after both."""
    name = run_name(mode, folder)
    clean_export(workdir / "lightning")
    (workdir / f"{name}.warnings.jsonl").unlink(missing_ok=True)
    cmd = pytest_command(args, [folder], workdir / f"{name}.xml", injected=mode == "injected")
    cmd += ["-n", args.workers] if args.workers not in ("0", "") else []
    cmd += ["-k", args.keyword] if args.keyword else []
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = datetime.datetime.now()
    with open(workdir / f"{name}.log", "w") as log:
        env = environment(workdir / f"{name}.warnings.jsonl")
        rc = subprocess.run(cmd, cwd=workdir / SUITE, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = (datetime.datetime.now() - start).total_seconds()
    print(f"[{name}] exit {rc} after {seconds:.0f} s", flush=True)
    runs_file = workdir / "runs.json"
    runs = json.loads(runs_file.read_text()) if runs_file.exists() else {}
    runs[name] = {"command": " ".join(cmd[1:]), "exit": rc, "seconds": round(seconds)}
    runs_file.write_text(json.dumps(runs, indent=1))
    return rc


def confirm_alone(args: argparse.Namespace, workdir: Path, test_ids: list[str]) -> dict[str, str]:
    """The regressions re-run, injected, without the rest of the suite: each alone in a fresh process
    (``--confirm alone``), or those of one file together in a fresh process (``--confirm file``, the
    default: a fresh pytest costs tens of seconds here). Returns each one's outcome there."""
    groups: dict[str, list[str]] = {}
    for tid in test_ids:
        groups.setdefault(tid if args.confirm == "alone" else tid.partition("::")[0], []).append(tid)
    outcomes: dict[str, str] = {}
    alone = workdir / "alone"
    alone.mkdir(exist_ok=True)
    for i, ids in enumerate(groups.values()):
        xml = alone / f"{i}.xml"
        xml.unlink(missing_ok=True)
        clean_export(workdir / "lightning")
        with open(alone / f"{i}.log", "w") as log:
            env = environment(alone / "warnings.jsonl")
            cmd = pytest_command(args, ids, xml, injected=True)
            subprocess.run(cmd, cwd=workdir / SUITE, env=env, stdout=log, stderr=subprocess.STDOUT)
        got = read_junit(xml) if xml.exists() else {}
        for tid in ids:
            outcomes[tid] = str(got.get(tid, {}).get("outcome") or "not run")
        print(f"  re-run {i + 1}/{len(groups)}: {Counter(outcomes[t] for t in ids)} {ids[0]}", flush=True)
    return outcomes


# ---------------------------------------------------------------- compare


def test_id(case: ET.Element) -> str:
    """The pytest node id (relative to tests/tests_pytorch) of an xunit1 testcase."""
    file = case.get("file", "")
    module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
    classname = case.get("classname", "")
    classes = classname[len(module) + 1 :] if module and classname.startswith(module + ".") else ""
    parts = [
        file.removeprefix("tests/").removeprefix("tests_pytorch/"),
        *filter(None, classes.split(".")),
        case.get("name", ""),
    ]
    return "::".join(parts)


def _outcome(case: ET.Element) -> tuple[str, str]:
    for tag, outcome in (("failure", "failed"), ("error", "error")):
        el = case.find(tag)
        if el is not None:
            lines = (el.get("message") or el.text or "").strip().splitlines()
            return outcome, lines[0][:300] if lines else ""
    if case.find("skipped") is not None:
        return "skipped", ""
    return "passed", ""


def read_junit(path: Path) -> dict[str, dict[str, object]]:
    tests: dict[str, dict[str, object]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = _outcome(case)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests[test_id(case)] = {
            "outcome": outcome,
            "message": message,
            "trainers": int(props.get("exact_resume_trainers") or 0),
        }
    return tests


def _normalised(message: str) -> str:
    """A message with its paths, object addresses and numbers made the same in both runs."""
    message = re.sub(r"0x[0-9a-fA-F]+", "ADDR", re.sub(r"(/[^\s'\"]+)+", "PATH", message))
    return re.sub(r"\d+(\.\d+)?", "N", message)[:160]


def new_warnings(workdir: Path, folders: list[str]) -> dict[str, object]:
    """Warnings of the injected run that the same test did not raise stock: per message, how many tests."""

    def read(mode: str) -> set[tuple[str, str, str]]:
        paths = [workdir / f"{run_name(mode, folder)}.warnings.jsonl" for folder in folders]
        lines = [line for path in paths if path.exists() for line in path.read_text().splitlines()]
        recs = (json.loads(line) for line in lines)
        return {(r["nodeid"], r["category"], _normalised(r["message"])) for r in recs}

    added = read("injected") - read("stock")
    per_message = Counter(f"{cat}: {msg}" for _, cat, msg in added)
    return {
        "tests_with_new_warnings": len({nodeid for nodeid, _, _ in added}),
        "by_message": dict(per_message.most_common()),
    }


def compare(stock: dict, injected: dict) -> dict[str, object]:
    ids = sorted(set(stock) | set(injected))
    pair = {tid: (stock.get(tid, {}).get("outcome"), injected.get(tid, {}).get("outcome")) for tid in ids}
    regressions = [tid for tid, (s, i) in pair.items() if s == "passed" and i in FAILED]
    outcomes: dict[str, dict[str, str]] = {}
    for tid, (s, i) in pair.items():
        file, _, rest = tid.partition("::")
        outcomes.setdefault(file, {})[rest] = CODE[s] + CODE[i]
    counts = {
        f"{run}_{o}": sum(1 for p in pair.values() if p[k] == o)
        for k, run in enumerate(("stock", "injected"))
        for o in ("passed", "failed", "error", "skipped")
    }
    counts |= {
        "tests": len(ids),
        "regressions": len(regressions),
        "fixed": sum(1 for s, i in pair.values() if s in FAILED and i == "passed"),
    }
    details = {tid: {"message": injected[tid]["message"], "trainers": injected[tid]["trainers"]} for tid in regressions}
    return {"counts": counts, "regressions": details, "outcomes": outcomes}


# ---------------------------------------------------------------- main


def versions(python: str) -> dict[str, str]:
    code = (
        "import json, platform; from importlib.metadata import version as v; print(json.dumps("
        "{'python': platform.python_version(), **{p: v(p) for p in "
        "('lightning', 'torch', 'torchdata', 'pytest', 'lightning-resume')}}))"
    )
    return json.loads(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout)


def exported(args: argparse.Namespace, workdir: Path, installed: str) -> dict[str, str]:
    """Export unless the workdir already holds this source's export of the same ref (runs of other
    folders into the same workdir then share it, and a run still going is not pulled from under)."""
    meta_file = workdir / "export.json"
    if args.mode == "compare" or (meta_file.exists() and not args.fresh):
        meta = json.loads(meta_file.read_text())
        if args.mode == "compare" or (
            meta["source"] == str(Path(args.source).resolve()) and args.ref in (None, meta["ref"])
        ):
            return dict(meta)
    meta = export(Path(args.source).resolve(), args.ref, workdir / "lightning", installed)
    meta_file.write_text(json.dumps(meta))
    print(f"exported {meta['ref']} ({meta['ref_note']}) to {workdir / 'lightning'}", flush=True)
    return meta


def read_runs(workdir: Path, folders: list[str]) -> tuple[dict, dict, list[str]]:
    """Both runs' results over the folders that have both junit files, and the folders that have not."""
    stock: dict = {}
    injected: dict = {}
    missing = []
    for folder in folders:
        s, i = workdir / f"{run_name('stock', folder)}.xml", workdir / f"{run_name('injected', folder)}.xml"
        if not (s.exists() and i.exists()):
            missing.append(folder)
            continue
        stock |= read_junit(s)
        injected |= read_junit(i)
    return stock, injected, missing


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode != "compare" and not args.source:
        sys.exit("--source PATH (Lightning's repository) is required, or set LIGHTNING_SOURCE")
    installed = installed_lightning(args.python)
    workdir = (args.workdir or Path(tempfile.gettempdir()) / f"lightning-suite-{installed}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    meta = exported(args, workdir, installed)
    for folder in args.dirs if args.mode != "compare" else []:
        for mode in ("stock", "injected") if args.mode == "both" else (args.mode,):
            run_mode(args, mode, folder, workdir)
    stock, injected, missing = read_runs(workdir, args.dirs)
    if missing:
        print(f"no stock and injected junit yet for {missing}: compared without them", flush=True)
    result = compare(stock, injected)
    if result["regressions"] and not args.no_confirm:
        for tid, outcome in confirm_alone(args, workdir, list(result["regressions"])).items():
            result["regressions"][tid]["alone"] = outcome
    report = {
        "date": datetime.date.today().isoformat(),
        "versions": versions(args.python),
        **meta,
        "dirs": [d for d in args.dirs if d not in missing],
        "keyword": args.keyword,
        "runs": json.loads(runs_file.read_text()) if (runs_file := workdir / "runs.json").exists() else {},
        "confirm": None if args.no_confirm else args.confirm,
        "new_warnings": new_warnings(workdir, args.dirs),
        **result,
    }
    out = args.results or HERE / "results" / f"lightning-{meta['ref']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(result["counts"]), f"\nwritten to {out}")
    for tid, d in result["regressions"].items():
        print(f"REGRESSION {tid}  [alone: {d.get('alone', '-')}]  {d['message'][:160]}")
    return 1 if result["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())
