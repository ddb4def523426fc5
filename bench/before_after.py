"""The engines bench (bench/engines_h200.py) from two source trees, alternately, on one device:
"before", a commit's tree (`git archive REF`, default 6eeb744: the commit before the torch wing's
redesign) unpacked into a temporary folder, and "after", this tree.

    PYTHONPATH=. python3 bench/before_after.py --only torch --d768 torch --repeat 2 --out $OUT/ba
    PYTHONPATH=. python3 bench/before_after.py --only torch --shape d768 --steps 10 --warmup 3
    PYTHONPATH=. python3 bench/before_after.py --cpu-smoke --only torch --steps 1 --warmup 1 --repeat 1
    git archive 6eeb744 -o before.tar; python3 bench/before_after.py --before-tar before.tar ...

Why subprocesses. The two trees are two versions of the same packages (core, engines, ...): one
Python process can import only one of them, so the two cannot share a process the way the bench's
variants do. Each leg is instead a process of its own, `python bench/engines_h200.py --only X
--steps N --warmup W --out DIR` run from its tree (cwd and PYTHONPATH that tree, so its own
packages are imported: checked before the first leg), and the legs alternate, before, after,
before, after, ... (--repeat pairs) on the same device within one call, so drift of the machine
(clocks, heat, neighbours) falls on both trees alike. Every leg pays its own start-up and
compilation, which are not timed (the bench times its steps after its warm-up).

Command lines. A tree's bench is asked only for flags it has (read from its argparse calls):
--shape and --d768 must exist in both (6eeb744's has them); --cpu-smoke, which 6eeb744's lacks,
becomes --tiny there with the GPU hidden (CUDA_VISIBLE_DEVICES empty, JAX_PLATFORMS=cpu: its
--tiny runs on a GPU where it sees one). Both legs run in this process's environment less the
MOE_LADDER_* variables (6eeb744's engines read switches from there; this tree's do not).

Output (--out): before_after.md (a table per variant and shape: each leg's tokens/s, their mean
and spread, after/before by the means and the range of the per-pair ratios, and each leg's last
timed loss) and before_after.json (the same with every leg's rows, command line and log tail),
both rewritten after every leg so a run cut short keeps what it measured. The legs' own folders
go to --legs-dir (a temporary folder by default, so --out holds two files).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REF = "6eeb744"
BENCH = "bench/engines_h200.py"
LEGS = ("before", "after")
T_START = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T_START:6.1f}s]", *a, flush=True)


# ---- the two trees ---------------------------------------------------------------------------------


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def extract(tar: Path, dest: Path) -> str | None:
    """Unpack a tar file (plain or compressed); the commit `git archive` wrote into its header."""
    with tarfile.open(tar) as tf:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, 3.11.4 and later
            tf.extractall(dest, filter="data")
        else:
            tf.extractall(dest)
        return tf.pax_headers.get("comment")


def unpack_before(dest: Path, ref: str, tar: str | None) -> dict:
    """The before tree in `dest`: the tar file `tar` (a `git archive` made where the history is),
    else `git archive ref` of this repository. Returns where it came from."""
    dest.mkdir(parents=True, exist_ok=True)
    if tar:
        return {"source": f"tar {Path(tar).resolve()}", "ref": None, "commit": extract(Path(tar), dest)}
    try:
        commit = git("rev-parse", "--verify", f"{ref}^{{commit}}")
        data = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, check=True,
                              capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"no git history here for {ref} ({err}): make its tree where there is one, "
                         f"`git archive {ref} -o before.tar`, and pass --before-tar before.tar") from err
    tar_path = dest.parent / "before.tar"
    tar_path.write_bytes(data)
    extract(tar_path, dest)
    tar_path.unlink()
    return {"source": f"git archive {ref}", "ref": ref, "commit": commit}


def after_info() -> dict:
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return {"source": str(ROOT), "commit": git("rev-parse", "HEAD"), "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):  # a copy of the working tree without .git
        return {"source": str(ROOT), "commit": None}


def bench_flags(tree: Path) -> set[str]:
    """The command-line flags a tree's bench defines."""
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", (tree / BENCH).read_text()))


def bench_variants(tree: Path) -> set[str]:
    """The variant names a tree's bench knows (its runners table: "name": (run_...)."""
    return set(re.findall(r"\"([\w-]+)\": \(run_\w+", (tree / BENCH).read_text()))


def leg_command(tree: Path, args, out_dir: Path, budget_s: float) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one leg of `tree`, asking only for the flags its bench has."""
    flags = bench_flags(tree)
    cmd = [args.python, str(tree / BENCH), "--only", args.only, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--out", str(out_dir)]
    if args.shape != "olmoe":
        cmd += ["--shape", args.shape]
    if args.d768:
        cmd += ["--d768", args.d768]
    if "--budget-s" in flags:
        cmd += ["--budget-s", f"{max(budget_s, 1.0):.0f}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_LADDER_")}
    # The tree first; the caller's other entries (packages installed with --target, say) after it,
    # less the repository itself, so one leg never imports the other leg's code.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and p != "." and Path(p).resolve() != ROOT]
    env.update({"PYTHONPATH": os.pathsep.join([str(tree), *extra]), "PYTHONUNBUFFERED": "1"})
    if args.cpu_smoke:
        cmd.append("--cpu-smoke" if "--cpu-smoke" in flags else "--tiny")
        env.update({"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"})
    missing = [f for f in cmd if f.startswith("--") and f not in flags]
    if missing:
        raise SystemExit(f"{tree / BENCH} has no {', '.join(missing)}")
    return cmd, env


def check_tree(tree: Path, args) -> None:
    """The tree's bench knows every variant asked for, and a process started as its legs are
    imports the tree's own packages (not an installed copy)."""
    names = [n for n in (args.only + "," + args.d768).split(",") if n]
    unknown = sorted(set(names) - bench_variants(tree))
    if unknown:
        raise SystemExit(f"{tree / BENCH} has no variant {', '.join(unknown)}")
    _, env = leg_command(tree, args, tree, 1.0)
    got = subprocess.run([args.python, "-c", "import core, engines; print(engines.__file__)"], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=300)
    path = Path(got.stdout.strip() or "?").resolve()
    if got.returncode or tree.resolve() not in path.parents:
        raise SystemExit(f"a leg from {tree} imports engines from {path} {got.stderr[-500:]}")


# ---- legs and the table -----------------------------------------------------------------------------


def run_leg(tree: Path, leg: str, i: int, args, legs_dir: Path, budget_s: float) -> dict:
    out_dir = legs_dir / f"{i}_{leg}"
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd, env = leg_command(tree, args, out_dir, budget_s)
    log(f"leg {i} {leg}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    log_path = legs_dir / f"{i}_{leg}.log"
    rec = {"leg": leg, "pair": i // 2, "cmd": cmd, "cwd": str(tree)}
    with open(log_path, "w") as f:
        try:
            rec["rc"] = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                                       timeout=max(budget_s, 60.0) + args.grace_s).returncode
        except subprocess.TimeoutExpired:
            rec["rc"] = "timeout"
    rec["wall_s"] = time.perf_counter() - t0
    rec["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    results = out_dir / "results.jsonl"
    rec["rows"] = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    for r in rec["rows"]:
        r.get("info", {}).pop("breakdown", None)
    got = [f"{r['variant']} {r['tokens_per_s']:,.0f}" for r in rec["rows"] if "tokens_per_s" in r]
    log(f"leg {i} {leg}: rc {rec['rc']}, {rec['wall_s']:.0f} s, tokens/s: {', '.join(got) or 'none'}")
    return rec


def spread(xs: list[float]) -> float:
    """(max - min) / mean."""
    return (max(xs) - min(xs)) / mean(xs) if len(xs) > 1 else 0.0


def summarise(legs: list[dict]) -> list[dict]:
    """One entry per (variant, shape) in the order first measured: each leg's tokens/s in leg
    order, the means, spreads, after/before of the means and of each complete pair."""
    cells: dict[tuple, dict] = {}
    for rec in legs:
        for r in rec["rows"]:
            key = (r["variant"], r["key"][0], r["key"][1])
            c = cells.setdefault(key, {"variant": key[0], "shape": f"{key[1]} seq {key[2]}",
                                       "before": {}, "after": {}, "loss": {}, "errors": []})
            if "tokens_per_s" in r:
                c[rec["leg"]][rec["pair"]] = r["tokens_per_s"]
                c["loss"].setdefault(rec["leg"], r["timed_losses"][-1])
            else:
                c["errors"].append(f"{rec['leg']} pair {rec['pair']}: {r.get('error', '?')[:200]}")
    out = []
    for c in cells.values():
        b, a = c.pop("before"), c.pop("after")
        c["before_tps"], c["after_tps"] = [b[k] for k in sorted(b)], [a[k] for k in sorted(a)]
        c["pair_ratios"] = [a[k] / b[k] for k in sorted(set(a) & set(b))]
        if b and a:
            c["before_mean"], c["after_mean"] = mean(b.values()), mean(a.values())
            c["before_spread"], c["after_spread"] = spread(list(b.values())), spread(list(a.values()))
            c["ratio"] = c["after_mean"] / c["before_mean"]
        out.append(c)
    return out


def each(xs: list[float]) -> str:
    return ", ".join(f"{x:,.0f}" for x in xs) or "-"


def table_md(meta: dict, cells: list[dict]) -> str:
    b, a = meta["before"], meta["after"]
    lines = [f"Before: {b['source']} ({(b.get('commit') or '?')[:12]}); after: {a['source']} "
             f"({(a.get('commit') or '?')[:12]}{', uncommitted changes' if a.get('dirty') else ''}). "
             f"bench/engines_h200.py --only {meta['only']}{' --d768 ' + meta['d768'] if meta['d768'] else ''} "
             f"--shape {meta['shape']}, {meta['warmup']} warm-up + {meta['steps']} timed steps"
             f"{', --cpu-smoke' if meta['cpu_smoke'] else ''}; legs in the order "
             f"{', '.join(meta['order']) or 'none'}{' (stopped at the budget)' if meta.get('stopped') else ''}.", "",
             "| variant | shape | before tokens/s (each leg) | after tokens/s (each leg) | before mean (spread) | "
             "after mean (spread) | after / before | per-pair ratios | last timed loss before / after |",
             "|---|---|---|---|---:|---:|---:|---|---|"]
    for c in cells:
        loss = " / ".join(f"{c['loss'][k]:.4f}" if k in c["loss"] else "-" for k in LEGS)
        if "ratio" in c:
            pr = c["pair_ratios"]
            pairs = f"{min(pr):.3f} .. {max(pr):.3f} ({len(pr)})" if pr else "-"
            lines.append(f"| {c['variant']} | {c['shape']} | {each(c['before_tps'])} | {each(c['after_tps'])} | "
                         f"{c['before_mean']:,.0f} ({c['before_spread']:.1%}) | {c['after_mean']:,.0f} "
                         f"({c['after_spread']:.1%}) | {c['ratio']:.3f}x | {pairs} | {loss} |")
        else:
            lines.append(f"| {c['variant']} | {c['shape']} | {each(c['before_tps'])} | {each(c['after_tps'])} | "
                         f"- | - | - | - | {loss} |")
        lines += [f"| | | failed: {e} | | | | | | |" for e in c["errors"]]
    failed = [f"{r['leg']} pair {r['pair']}: rc {r['rc']}" for r in meta["legs"] if r["rc"] != 0]
    if failed:
        lines += ["", "Legs that did not exit cleanly (their log tails are in before_after.json): " + "; ".join(failed)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="torch", help="variants of bench/engines_h200.py, in both trees")
    ap.add_argument("--d768", default="", help="variants run at the d768 shape after --only, in the same leg")
    ap.add_argument("--shape", default="olmoe", choices=("olmoe", "d768"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2, help="before/after pairs, run before, after, before, ...")
    ap.add_argument("--ref", default=DEFAULT_REF, help="the before commit (git archive in this repository)")
    ap.add_argument("--before-tar", default="", help="the before tree as a tar file (`git archive REF -o FILE`) "
                                                     "where this copy has no git history")
    ap.add_argument("--cpu-smoke", action="store_true", help="both legs tiny on the CPU (--tiny before --cpu-smoke)")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="start no leg that would end past this, judged by the longest leg so far")
    ap.add_argument("--grace-s", type=float, default=60.0, help="a leg is killed this long past the budget")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--legs-dir", default="", help="the legs' output folders and logs (default: a temporary one)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    legs_dir = Path(args.legs_dir or tempfile.mkdtemp(prefix="before_after_legs_"))
    legs_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="before_after_tree_") as tmp:
        before = Path(tmp) / "before"
        meta = {"before": unpack_before(before, args.ref, args.before_tar or None), "after": after_info(),
                "only": args.only, "d768": args.d768, "shape": args.shape, "steps": args.steps,
                "warmup": args.warmup, "repeat": args.repeat, "cpu_smoke": args.cpu_smoke,
                "legs_dir": str(legs_dir), "order": [], "legs": []}
        trees = {"before": before, "after": ROOT}
        for leg in LEGS:
            check_tree(trees[leg], args)
        log(f"before {meta['before']}, after {meta['after']}; legs in {legs_dir}")
        longest = 0.0
        for i in range(2 * max(args.repeat, 1)):
            leg = LEGS[i % 2]
            left = args.budget_s - (time.perf_counter() - T_START)
            if i and longest > left:
                log(f"stop before leg {i} ({leg}): {left:.0f} s left, the longest leg took {longest:.0f} s")
                meta["stopped"] = True
                break
            rec = run_leg(trees[leg], leg, i, args, legs_dir, left)
            longest = max(longest, rec["wall_s"])
            meta["order"].append(leg)
            meta["legs"].append(rec)
            cells = summarise(meta["legs"])
            (out / "before_after.json").write_text(json.dumps({**meta, "table": cells}, indent=1))
            (out / "before_after.md").write_text(table_md(meta, cells))
    table = (out / "before_after.md").read_text() if meta["legs"] else "no leg ran\n"
    print(table)
    return 0 if meta["legs"] and all(r["rc"] == 0 for r in meta["legs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
