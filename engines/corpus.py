"""An offline corpus from what the machine already has: installed packages' source and prose.

    python -m engines.corpus build --out DIR [--tokenizer tok.json ...] [--no-native]
    (or `ladder data corpus`, or `make corpus`)

It walks the interpreter's site-packages (and /usr/lib/python3*, the standard library) for Python
source (*.py, *.pyi) and prose (*.md, *.rst, *.txt), and, unless --no-native, site-packages,
/usr/include, /usr/local/include and /usr/local/cuda*/include for C, C++ and CUDA (*.h, *.hpp,
*.hh, *.cuh, *.inl, *.c, *.cc, *.cpp, *.cxx, *.cu). A file is one document; files larger than
MAX_FILE_BYTES (generated tables), not valid UTF-8, or holding NUL bytes are skipped, and
duplicates (the same content at several paths) are kept once, by sha256. Documents are ordered
by their content hash, so any tail of a part is a spread of packages, and written as
    DIR/<part>/shard-NNNNN.jsonl   one {"text", "path", "package", "license"} object a line
    DIR/manifest.json              per part: files, bytes, documents, the top packages by bytes
                                   with their licence fields, and (with --tokenizer) the part's
                                   token count under each tokenizer's sha256
with python, docs and native the three parts (the data sources `builtin: packages_python`,
`packages_docs`, `packages_native`). Every file is written to a temporary name and renamed; the
manifest comes last. Licence hints are each package's own metadata (License-Expression, License,
or its "License ::" classifiers); system headers name their Debian package and the licence line
of its /usr/share/doc/<package>/copyright.

Dependencies: the standard library, plus numpy and tokenizers for --tokenizer counts, so it runs
on a bare GPU machine's Python.
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import hashlib
import json
import multiprocessing as mp
import os
import site
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

PARTS = {
    "python": (".py", ".pyi"),
    "docs": (".md", ".rst", ".txt"),
    "native": (".h", ".hpp", ".hh", ".cuh", ".inl", ".c", ".cc", ".cpp", ".cxx", ".cu"),
}
MAX_FILE_BYTES = 2 * 2**20
SHARD_BYTES = 32 * 2**20
SKIP_DIRS = {"__pycache__", ".git", "node_modules"}


def python_roots() -> list[Path]:
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]}
    roots |= set(site.getsitepackages())
    roots |= set(glob.glob("/usr/lib/python3*/")) | set(glob.glob("/usr/local/lib/python3*/"))
    return _outermost(roots)


def native_roots() -> list[Path]:
    return _outermost(set(map(str, python_roots())) | {"/usr/include", "/usr/local/include"}
                      | set(glob.glob("/usr/local/cuda*/include")) | set(glob.glob("/usr/local/cuda*/targets/*/include")))


def _outermost(paths: set[str]) -> list[Path]:
    real = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    return [Path(p) for p in real if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in real)]


# ---- licence hints ---------------------------------------------------------------------------


def _dist_licence(meta) -> str:
    for key in ("License-Expression", "License"):
        v = (meta.get(key) or "").strip()
        if v and v.upper() != "UNKNOWN":
            line = v.splitlines()[0].strip()
            return line[:80] + ("..." if len(line) > 80 or len(v.splitlines()) > 1 else "")
    cls = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    return "; ".join(cls) or "unknown"


def package_owners(roots: list[Path]) -> dict[str, tuple[str, str]]:
    """realpath of a file -> (package, licence hint): Python distributions, then Debian packages."""
    from importlib import metadata

    owners: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions(path=[str(r) for r in roots] + [p for p in sys.path if "-packages" in p]):
        try:
            name, lic = dist.metadata["Name"], _dist_licence(dist.metadata)
            for f in dist.files or ():
                owners.setdefault(os.path.realpath(dist.locate_file(f)), (name, lic))
        except (OSError, ValueError, csv.Error):  # a broken RECORD or metadata file: its files get no hint
            continue
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = Path(lst).stem.split(":")[0]
        lic = _debian_licence(pkg)
        try:
            for line in open(lst, encoding="utf-8", errors="replace"):
                owners.setdefault(line.strip(), (f"deb:{pkg}", lic))
        except OSError:
            continue
    return owners


def _debian_licence(pkg: str) -> str:
    path = Path("/usr/share/doc") / pkg / "copyright"
    try:
        for line in open(path, encoding="utf-8", errors="replace"):
            if line.startswith("License:"):
                return line.split(":", 1)[1].strip() or f"see {path}"
    except OSError:
        return "unknown"
    return f"see {path}"


def _fallback_owner(path: str) -> tuple[str, str]:
    if "/cuda" in path:
        return "cuda-toolkit", "NVIDIA CUDA Toolkit EULA"
    parts = path.split("-packages/", 1)
    if len(parts) == 2:
        return parts[1].split("/", 1)[0], "unknown"
    if "/python3" in path:
        return "python-stdlib", "PSF-2.0"
    return "system", "unknown"


# ---- walking ---------------------------------------------------------------------------------


def _files(roots: list[Path], suffixes: tuple[str, ...]) -> list[str]:
    out = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.lower().endswith(suffixes)]
    return out


def _read(path: str) -> str | None:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES or os.path.islink(path) and not os.path.exists(path):
            return None
        raw = open(path, "rb").read()
    except OSError:
        return None
    if not raw.strip() or b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _write_shards(out: Path, part: str, docs: list[dict]) -> list[str]:
    d = out / part
    d.mkdir(parents=True, exist_ok=True)
    names, buf, size = [], [], 0

    def flush():
        nonlocal buf, size
        name = f"shard-{len(names):05d}.jsonl"
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(buf)
        os.replace(tmp, d / name)
        names.append(name)
        buf, size = [], 0

    for doc in docs:
        line = json.dumps(doc, ensure_ascii=False) + "\n"
        buf.append(line)
        size += len(line)
        if size >= SHARD_BYTES:
            flush()
    if buf:
        flush()
    for old in d.glob("shard-*.jsonl"):  # a previous, larger build's leftovers
        if old.name not in names:
            old.unlink()
    return names


# ---- token counts ----------------------------------------------------------------------------


def _count_file(args: tuple[str, str]) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok_path, shard = args
    tok = Tokenizer.from_file(tok_path)
    texts = [json.loads(line)["text"] for line in open(shard, encoding="utf-8") if line.strip()]
    n = 0
    for i in range(0, len(texts), 256):
        n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
    return n, sum(len(t.encode()) for t in texts)


def count_tokens(tok_path: str, shards: list[Path], workers: int) -> tuple[int, int]:
    """(tokens, bytes) of the shards under a tokenizer, one end-of-text token a document included."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    with mp.get_context("spawn").Pool(workers) as pool:
        res = pool.map(_count_file, [(tok_path, str(s)) for s in shards], chunksize=1)
    return sum(r[0] for r in res), sum(r[1] for r in res)


# ---- build -----------------------------------------------------------------------------------


def build(out: str | Path, tokenizers: list[str] = (), native: bool = True, workers: int | None = None,
          log=print) -> dict:
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    proots, nroots = python_roots(), native_roots()
    owners = package_owners(proots)
    seen: set[str] = set()
    manifest = {"built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_python": sys.version.split()[0],
                "roots": {"python": list(map(str, proots)), "native": list(map(str, nroots)) if native else []},
                "max_file_bytes": MAX_FILE_BYTES, "parts": {}}
    for part, suffixes in PARTS.items():
        if part == "native" and not native:
            continue
        docs, by_pkg, dupes, skipped = [], collections.Counter(), 0, 0
        licences: dict[str, str] = {}
        for path in _files(nroots if part == "native" else proots, suffixes):
            text = _read(path)
            if text is None:
                skipped += 1
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:
                dupes += 1
                continue
            seen.add(digest)
            pkg, lic = owners.get(os.path.realpath(path)) or _fallback_owner(path)
            licences.setdefault(pkg, lic)
            by_pkg[pkg] += len(text.encode())
            docs.append({"text": text, "path": path, "package": pkg, "license": lic, "_h": digest})
        docs.sort(key=lambda d: d.pop("_h"))
        names = _write_shards(out, part, docs)
        info = {"files": len(docs), "bytes": sum(by_pkg.values()), "duplicates_dropped": dupes,
                "skipped": skipped, "shards": names,
                "top_packages": [{"package": p, "bytes": b, "license": licences[p]} for p, b in by_pkg.most_common(25)],
                "tokens": {}}
        log(f"{part}: {len(docs):,} files, {info['bytes'] / 1e6:.1f} MB in {len(names)} shards "
            f"({dupes:,} duplicates, {skipped:,} skipped)")
        for tok in tokenizers:
            t1 = time.time()
            n, nbytes = count_tokens(str(Path(tok).resolve()), [out / part / s for s in names], workers or os.cpu_count())
            sha = hashlib.sha256(Path(tok).read_bytes()).hexdigest()
            info["tokens"][sha] = {"tokenizer": Path(tok).name, "tokens": n, "bytes_per_token": nbytes / max(n, 1),
                                   "seconds": round(time.time() - t1, 1)}
            log(f"  {Path(tok).name}: {n:,} tokens ({nbytes / max(n, 1):.2f} bytes a token, "
                f"{nbytes / 1e6 / max(time.time() - t1, 1e-9):.1f} MB/s)")
        manifest["parts"][part] = info
        del docs
    manifest["seconds"] = round(time.time() - t0, 1)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".manifest.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, out / "manifest.json")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engines.corpus", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the corpus")
    b.add_argument("--out", required=True)
    b.add_argument("--tokenizer", action="append", default=[], help="count tokens under this tokenizer.json")
    b.add_argument("--no-native", action="store_true", help="leave out C, C++ and CUDA")
    b.add_argument("--workers", type=int, default=None)
    a = ap.parse_args(argv)
    for t in a.tokenizer:
        if not Path(t).is_file():
            print(f"error: tokenizer file {t} does not exist", file=sys.stderr)
            return 2
    build(a.out, a.tokenizer, native=not a.no_native, workers=a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
