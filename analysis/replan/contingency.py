"""Contingency replans for a live run: each option is a complete new spec plus a table row.

    state = RunState.build(df, spec, ref=None, tokens_per_s=None, forecast=None, now=None)
    plan = make_replan(state, deadline=None, force=False, lr_factor=0.5, forecaster="auto")
    paths = write_replan(plan, out_dir)

An option's spec has a new id and records its lineage: parent_id (the run's spec id), reason, and
resume_step (the parent checkpoint it continues from: the engine loads
<parent run dir>/checkpoints/step_<resume_step> and goes on from there). Its row has the finish
date at the run's throughput, the device-hours still to spend, and the forecast final loss with an
interval from the curve model under the option's own schedule (analysis.replan.run_forecaster).

Options (Marin's contingency plan):

- `keep`: the plan as it is; projected finish and final loss.
- `shorten`: a shorter token horizon that meets the deadline. The LR decay is re-timed through
  core.spec.Rejoin (linear and cosine decays: from the resume step the LR goes, in the same shape,
  from its value there to min_lr_ratio x peak at the new end; WSD and constant runs still in their
  flat part just get the new total, with the warmup pinned in steps). Checked here: the LR is the
  parent's at every step before the join, continuous at it, and reaches the minimum at the new end.
  Allowed by default only while the run is within the first quarter of its token budget; later it
  needs force=True (--force), and the row says so. The data phases stay at their planned token
  positions (a midtrain phase past the new end is cut).
- `shorten_mix`: the same horizon with the data mix re-timed for it: phases that have not started
  keep their fraction of the new budget (an 80/20 pretrain/midtrain split stays 80/20). Only when
  the spec has phases.
- Token drops over budget (monitor flag `token_drops`): `capacity` raises both capacity factors
  (memory per GPU from core.costs; refused when it no longer fits hardware.hbm_gb), `dropless`
  switches to ragged dispatch, `sequence_balance` balances the router per sequence.
- A critical flag (any but token drops and a failed run: analysis.replan.rewind): rewind to the
  latest kept checkpoint strictly before the onset of the earliest one (its evidence's onset_step
  where the monitor estimated one, the calibrated sequential tests; else its first step), the
  run's own or, when it keeps none that early, one of the run it continues (lineage.parent_id,
  found through its seed checkpoint's `initialised_from` or the ledger; the option's lineage then
  names that run and its row its run dir); the row names the checkpoint (step and directory), the
  onset and the flag. With no kept checkpoint before the onset anywhere there is no rewind
  option, and the replan's notes and recommendation say why. The rewinds continue with
  `rewind_zloss` (logit z-loss raised to 1e-4, or x10 when already there), `rewind_lower_lr`
  (peak LR x `lr_factor`; note the new spec's schedule then describes the steps before the rewind
  at the lower peak too: those steps come from the parent checkpoint) or `rewind_redraw`. The data
  pipeline cannot skip batches (a step's batch is a function of (seed, step, mixture) and the spec
  has no offset), so the offending batches are not skipped and no skip option is offered (the
  replan says so): `rewind_redraw` re-draws every batch from the resume step on with a new data
  seed instead (the seed also keys the initial weights, which the checkpoint replaces, and the
  held-out eval batches).
- `enable_context`: the next gated stage of data.context_stages, when its gate (e.g.
  "drop_frac <= 0.07") holds on the measured drop fraction (mean of the last 20 points).

Where the run is (RunState), an option and a replan as values, the deadline, the context gate and
the files a replan writes live in analysis.replan.state.
"""

from __future__ import annotations

import math

import numpy as np

from analysis.replan.rewind import critical_onset, no_rewind_reason, rewind_point
from analysis.replan.run_forecaster import Forecaster, curve_forecaster
from analysis.replan.specs import derive, shorten_spec
from analysis.replan.state import (Option, Replan, ReplanError, RunState, _iso, _timing,  # noqa: F401 (the replanner's names)
                                   context_gate, parse_deadline, write_replan)
from core import costs
from core.spec import Spec

FIRST_QUARTER = 0.25
DATA_KINDS = ("train_eval_divergence", "repeated_batch")  # critical flags that point at the data: re-draw it


def make_replan(
    st: RunState,
    deadline: float | None = None,
    *,
    force: bool = False,
    lr_factor: float = 0.5,
    forecaster: Forecaster | None | str = "auto",
) -> Replan:
    spec = st.spec
    notes: list[str] = []
    if forecaster == "auto":
        forecaster = curve_forecaster(st)
    if forecaster is None:
        notes.append("no curve model available: options carry no loss forecast")
    if st.checkpoints_assumed:
        notes.append(f"no run directory: checkpoints assumed every {spec.run.checkpoint_every} steps")
    options: list[Option] = []

    # a finished run has nothing left to replan
    state_now = (st.ref.status().get("state") if st.ref else None) or "running"
    if state_now == "finished" or st.done_steps >= spec.total_steps:
        return Replan(st, deadline, [], None,
                      f"the run has finished ({min(st.done_steps, spec.total_steps)} of {spec.total_steps} steps): "
                      "there is nothing left to replan, so no options are offered", None,
                      notes + ["no options for a finished run: continue it with a new spec (a longer horizon "
                               "through lineage.resume_step) if more training is wanted"])

    # keep
    keep_note = {"running": "the run goes on as planned", "pending": "the run goes on as planned",
                 "finished": "the run has finished"}.get(
        state_now, f"the run has stopped ({state_now}): keeping the plan means resuming it as it is")
    keep = Option("keep", "keep the plan", spec, None, "no change", note=keep_note)
    _timing(keep, st, st.done_steps, deadline)
    if forecaster:
        keep.forecast = forecaster(st, spec, st.done_steps)
    options.append(keep)

    # shorten the horizon to meet the deadline
    if deadline is not None:
        join = st.latest_checkpoint()
        tps_step = spec.data.tokens_per_step
        fit_steps = int((deadline - st.now) * st.tokens_per_s // tps_step)
        new_total = join + fit_steps
        past_quarter = st.budget_frac > FIRST_QUARTER
        sched = spec.schedule
        warm = sched.warmup_steps if sched.warmup_steps is not None else int(round(sched.warmup_frac * spec.total_steps))
        reason_base = (f"deadline {_iso(deadline)}: at {st.tokens_per_s:,.0f} tokens/s the plan finishes {keep.finish}")
        refusal = None
        if keep.meets_deadline:
            refusal = "not needed: the plan meets the deadline"
        elif new_total >= spec.total_steps:
            refusal = ("not needed from the last checkpoint: resuming at step "
                       f"{join} the full horizon still fits")
        elif new_total <= join + 1 or int(round(sched.decay_end_frac * new_total)) <= join:
            refusal = (f"impossible: only {fit_steps} more step(s) fit before the deadline from checkpoint {join}; "
                       "no horizon ends in time")
        elif join < warm:
            refusal = f"the last checkpoint ({join}) is inside the warmup ({warm} steps): replan after it"
        variants = [("shorten", False)] + ([("shorten_mix", True)] if spec.data.phases else [])
        for kind, keep_frac in variants:
            title = ("shorten the horizon, data mix re-timed (phases keep their share of the new budget)" if keep_frac
                     else "shorten the horizon, LR decay re-timed")
            if refusal is not None:
                if kind == "shorten":
                    options.append(Option(kind, title, None, None, reason_base, allowed=False, note=refusal))
                continue
            reason = (f"{reason_base}; horizon cut from {spec.total_steps} to {new_total} steps "
                      f"({new_total * tps_step:,} tokens) with the LR decay re-timed from step {join}"
                      + ("; data phases keep their share of the new budget" if keep_frac else ""))
            new = shorten_spec(spec, join, new_total, keep_frac, kind, reason)
            opt = Option(kind, title, new, join, reason)
            if spec.data.phases and not keep_frac:
                cut = len(spec.data.phases) - len(new.data.phases)
                opt.note = (f"{cut} data phase(s) past the new end are cut" if cut
                            else "data phases stay at their planned token positions")
            if past_quarter and not force:
                opt.allowed = False
                opt.note = (f"refused: the run is at {st.budget_frac:.0%} of its token budget, past the first quarter "
                            "where a horizon change is allowed; --force to write it anyway. " + opt.note).strip()
            elif past_quarter:
                opt.note = (f"forced past the first quarter ({st.budget_frac:.0%} of the budget). " + opt.note).strip()
            _timing(opt, st, join, deadline)
            if forecaster:
                opt.forecast = forecaster(st, new, join)
            options.append(opt)

    # token drops
    drops = next((f for f in st.report.flags if f.kind == "token_drops"), None)
    if drops is not None:
        join = st.latest_checkpoint()
        d = st.drop_frac or float(drops.evidence.get("drop_frac_last") or 0.0)
        why = f"token drops {d:.1%} over the {st.report.settings['drop_budget']:.0%} budget (from step {drops.first_step})"
        m = spec.model
        cf = (m.capacity_factor_send, m.capacity_factor_recv)
        bump = max(0.1, 2.0 * d)
        new_cf = tuple(math.ceil(c * (1.0 + bump) * 20) / 20 for c in cf)
        options.append(_drop_option(st, "capacity", f"raise capacity factors {cf[0]:g}/{cf[1]:g} -> {new_cf[0]:g}/{new_cf[1]:g}",
                                    why, join, deadline, forecaster,
                                    {"model.capacity_factor_send": new_cf[0], "model.capacity_factor_recv": new_cf[1],
                                     "model.dispatch": "capacity"}))
        if m.dispatch != "dropless":
            options.append(_drop_option(st, "dropless", "switch to dropless (ragged) dispatch", why, join, deadline,
                                        forecaster, {"model.dispatch": "dropless"},
                                        note="memory for the routed rows follows the busiest expert (expert_load_max)"))
        if m.balance_scope != "sequence":
            options.append(_drop_option(st, "sequence_balance", "balance the router per sequence", why, join, deadline,
                                        forecaster, {"model.balance_scope": "sequence"}))

    # divergence: rewind to the latest checkpoint before the earliest critical onset
    onset = critical_onset(st.report)
    bad = onset.flag if onset else None
    no_rewind = None
    if onset is not None:
        point = rewind_point(st, onset.step)
        if point is None:
            no_rewind = no_rewind_reason(st, onset)
            notes.append(no_rewind)
        else:
            join = point.step
            text = bad.evidence.get("text", "") if isinstance(bad.evidence, dict) else ""
            why = (f"{onset.describe()}" + (f" ({text})" if text else "")
                   + f"; rewind to {point.describe()}, the latest kept before the onset")
            src = (point.run_dir, point.spec_id, point.path)
            z = spec.optim.z_loss
            new_z = 1e-4 if z < 1e-4 else z * 10
            options.append(_rewind_option(st, "rewind_zloss", f"rewind to checkpoint {join}, z-loss {z:g} -> {new_z:g}",
                                          why, join, deadline, forecaster, {"optim.z_loss": new_z}, src=src))
            new_lr = spec.optim.peak_lr * lr_factor
            options.append(_rewind_option(
                st, "rewind_lower_lr", f"rewind to checkpoint {join}, peak LR {spec.optim.peak_lr:g} -> {new_lr:g}", why,
                join, deadline, forecaster, {"optim.peak_lr": new_lr},
                note="the new peak applies from the resume step; earlier steps come from the parent checkpoint", src=src))
            options.append(_rewind_option(
                st, "rewind_redraw",
                f"rewind to checkpoint {join}, re-draw the data from there (seed {spec.seed} -> {spec.seed + 1})",
                why, join, deadline, forecaster, {"seed": spec.seed + 1},
                note="a new data seed replaces every batch from the resume step (and the held-out eval batches)",
                src=src))
            notes.append("skipping the offending batches is not possible: the data pipeline has no offset (a step's "
                         "batch is a function of seed, step and mixture), so no skip option is offered; "
                         "rewind_redraw draws other batches instead")

    # context-length gate
    gate = context_gate(st)
    if gate is not None and gate.get("allowed"):
        join = st.latest_checkpoint()
        stages = [c.model_dump(mode="json") for c in spec.data.context_stages]
        target = min((i for i, c in enumerate(spec.data.context_stages) if c.gated),
                     key=lambda i: spec.data.context_stages[i].start_frac)
        stages[target]["gated"] = False
        opt = Option("enable_context", f"enable the {spec.data.context_stages[target].seq_len}-token context stage",
                     derive(spec, "enable_context", gate["note"], join, **{"data.context_stages": stages}), join,
                     gate["note"], note="the curve model does not see context length: the forecast is the plan's")
        _timing(opt, st, join, deadline)
        opt.forecast = keep.forecast
        options.append(opt)

    notes += _monotone_in_tokens(options)
    notes += _uninformative(st, options)
    for o in options:
        _check_kept(spec, o)
    rec, text = _recommend(st, options, deadline, bad, drops, no_rewind)
    return Replan(st, deadline, options, rec, text, gate, notes)


SHAPE_KINDS = ("keep", "shorten", "shorten_mix")  # one schedule shape: the plan's, re-timed


def _uninformative(st: RunState, options: list[Option]) -> list[str]:
    """A note for each option whose forecast interval is at least as wide as the run's fall so far
    (RunState.fall_so_far): such an interval is honest but cannot tell one option from another."""
    fall = st.fall_so_far
    if fall is None:
        return []
    out = []
    for n, o in enumerate(options, 1):
        fc = o.forecast
        if fc and fc.width >= fall:
            out.append(f"option {n} ({o.kind}): its {fc.level:.0%} forecast interval ({fc.lo:.4g} to "
                       f"{fc.hi:.4g}) is as wide as the run's whole fall so far ({fall:.4g}): the run's curve "
                       "does not pin its final loss yet; read its mean as a guess")
    return out


def _monotone_in_tokens(options: list[Option]) -> list[str]:
    """More tokens under the same schedule shape never forecast a higher final loss: the options
    of SHAPE_KINDS, ordered by their total tokens, get their forecast means pooled where a longer
    one forecasts above a shorter one (pool-adjacent-violators, weights 1; the intervals move with
    their means). Returns a note for each pooling."""
    same = sorted([o for o in options if o.kind in SHAPE_KINDS and o.spec is not None and o.forecast],
                  key=lambda o: o.spec.data.total_tokens)
    if len(same) < 2:
        return []
    blocks = [[o] for o in same]
    i = 0
    while i < len(blocks) - 1:
        a = np.mean([o.forecast.mean for o in blocks[i]])
        b = np.mean([o.forecast.mean for o in blocks[i + 1]])
        if b > a:  # the longer forecasts higher: pool them
            blocks[i] += blocks.pop(i + 1)
            i = max(i - 1, 0)
        else:
            i += 1
    notes = []
    for blk in blocks:
        if len(blk) < 2:
            continue
        pooled = float(np.mean([o.forecast.mean for o in blk]))
        was = ", ".join(f"{o.kind} {o.spec.total_steps} steps {o.forecast.mean:.4g}" for o in blk)
        for o in blk:
            o.forecast = o.forecast.shifted(pooled, pooled_from=o.forecast.mean)
        notes.append(f"forecasts pooled to stay monotone in tokens (the curve model had {was}): more tokens under "
                     "the same schedule shape do not end higher")
    return notes


def _check_kept(parent: Spec, o: Option) -> None:
    """Every option keeps the run's checkpoint cadence, and its data seed unless re-drawing the
    data is the option. A failure is a bug, not bad input."""
    if o.spec is None:
        return
    if o.spec.run.checkpoint_every != parent.run.checkpoint_every or o.spec.run.eval_every != parent.run.eval_every:
        raise AssertionError(f"option {o.kind} changed the run's checkpoint or eval cadence")
    if o.kind != "rewind_redraw" and o.spec.seed != parent.seed:
        raise AssertionError(f"option {o.kind} changed the data seed")


def _drop_option(st, kind, title, why, join, deadline, forecaster, changes, note="") -> Option:
    new = derive(st.spec, kind, why + f"; {title}", join, **changes)
    opt = Option(kind, title, new, join, why + f"; {title}", note=note)
    mem = costs.memory_per_gpu(new)
    old = costs.memory_per_gpu(st.spec)
    opt.memory_gb = mem["total"] / 2**30
    delta = (mem["total"] - old["total"]) / 2**30
    extra = f"memory/GPU {opt.memory_gb:.2f} GiB ({delta:+.2f} GiB)"
    if not mem["fits"]:
        opt.allowed = False
        extra = f"refused: {extra} exceeds the {st.spec.hardware.hbm_gb:g} GB of one device"
    opt.note = "; ".join(x for x in (extra, note) if x)
    _timing(opt, st, join, deadline)
    if forecaster and opt.allowed:
        opt.forecast = forecaster(st, new, join)
    return opt


def _rewind_option(st, kind, title, why, join, deadline, forecaster, changes, note="", src=(None, None, None)) -> Option:
    """src: (run dir, spec id) of the earlier run in the lineage whose checkpoint `join` is (Nones
    for the run's own), and the checkpoint's directory (None where the checkpoints are assumed)."""
    new = derive(st.spec, kind, why + f"; {title}", join, resumes=src[1], **changes)
    opt = Option(kind, title, new, join, why + f"; {title}", note="; ".join(x for x in (why, note) if x),
                 resume_dir=src[0], resume_checkpoint=src[2])
    _timing(opt, st, join, deadline)
    if forecaster:
        opt.forecast = forecaster(st, new, join)
    return opt


def _recommend(st: RunState, options: list[Option], deadline, bad, drops, no_rewind=None) -> tuple[int | None, str]:
    by = {o.kind: i for i, o in enumerate(options) if o.allowed and o.spec is not None}
    if bad is not None:
        zl = st.spec.optim.z_loss
        gn_kinds = ("grad_norm_spike", "grad_norm_high", "grad_norm_growth", "grad_norm_above_envelope")
        if bad.kind in DATA_KINDS:
            k, why = "rewind_redraw", (f"the critical {bad.kind} flag at step {bad.first_step} points at the data: "
                                       "replay from before it on other batches")
        elif zl < 1e-4:
            k, why = "rewind_zloss", (f"the run diverged ({bad.kind} at step {bad.first_step}) with logit z-loss {zl:g}, "
                                      "below the 1e-4 that kept Marin's ladder stable as its horizon grew")
        elif bad.kind in gn_kinds or bad.kind in ("non_finite", "run_diverged", "loss_jump"):
            k, why = "rewind_lower_lr", (f"the run diverged ({bad.kind} at step {bad.first_step}) with z-loss already "
                                         f"{zl:g}: a lower peak LR is the surer fix")
        else:
            k, why = "rewind_redraw", (f"the critical {bad.kind} flag at step {bad.first_step}, without a divergence "
                                       "or grad-norm trouble, points at the data: replay from before it on other batches")
        if k in by:
            return by[k], f"option {by[k] + 1} ({k}): {why}"
        return None, why + (f"; {no_rewind}" if no_rewind else f" (the {k} option is not available)")
    if drops is not None:
        for k in ("capacity", "dropless", "sequence_balance"):
            if k in by:
                o = options[by[k]]
                return by[k], f"option {by[k] + 1} ({k}): token drops over budget; {o.title} ({o.note})"
    if deadline is not None and not options[0].meets_deadline:
        for k in ("shorten_mix", "shorten"):
            if k in by:
                o = options[by[k]]
                fc = o.forecast
                loss = f", forecast final loss {fc.mean:.4f}" if fc else ""
                return by[k], (f"option {by[k] + 1} ({k}): the plan finishes {options[0].finish}, after the deadline; "
                               f"{o.title} ends {o.finish} ({o.spec.total_steps} steps{loss})")
        refused = next((o for o in options if o.kind.startswith("shorten")), None)
        return 0, ("option 1 (keep): the deadline is missed, and no shortened horizon is allowed"
                   + (f" ({refused.note})" if refused else ""))
    return 0, "option 1 (keep): no flag calls for a change" + ("" if deadline is None else " and the plan meets the deadline")
