"""MasterAdamW's update on a side stream ($MOE_LADDER_TORCH_OVERLAP=1): the stages cover every
parameter once in the order the forward reads them; off a GPU it stays on the one stream and
trains as before. On a GPU, with the side stream held back by a sleep, the next forward still reads
each stage's updated weights (it waits for that stage's event), and gradients freed while the side
stream reads them are not handed to new tensors (they are recorded on the side stream)."""

import pytest
import torch

from engines.data import TokenStream
from engines.torch.engine import build_optimizer, launch_step, make_loss_fn, queue_update, read_step
from engines.torch.master import MasterAdamW, update_stages
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec

SPEC = micro_spec()


def _model(device="cpu"):
    model = MoETransformer(SPEC.model).to(device)
    model.load_numpy(init_params(SPEC.model, SPEC.seed))
    return model


def _master(model, overlap):
    plain = build_optimizer(model, SPEC, working=False)
    cuda = next(model.parameters()).is_cuda
    return MasterAdamW(model, plain.param_groups, lr=SPEC.optim.peak_lr, betas=(SPEC.optim.beta1, SPEC.optim.beta2),
                       eps=SPEC.optim.eps, dtype=torch.bfloat16 if cuda else torch.float32, overlap=overlap)


def test_the_stages_hold_every_parameter_once_in_forward_order():
    model = _model()
    stages = update_stages(model)
    assert [name for name, _ in stages] == ["embed", *(f"blocks.{i}" for i in range(len(model.blocks))), "head"]
    ids = [id(p) for _, ps in stages for p in ps]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert {id(p) for p in stages[-1][1]} == {id(model.lm_head), id(model.final_norm.weight)}


def test_off_a_gpu_the_update_stays_on_one_stream_and_trains_as_before():
    runs = []
    for overlap in (False, True):
        model = _model()
        opt = _master(model, overlap)
        assert opt._side is None
        fn = make_loss_fn(model, torch.device("cpu"), opt)
        stream = TokenStream.from_spec(SPEC)
        for s in range(2):
            x = torch.from_numpy(stream.batch(s)).long()
            vals, out = launch_step(model, fn, x, SPEC, opt)
            read_step(opt, queue_update(model, opt, vals, out, SPEC))
        runs.append(model)
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_held_back_side_stream_still_updates_what_the_next_forward_reads(monkeypatch):
    from engines.torch import master

    launch = master.adamw_launch

    def held_back(*args):  # the side stream's first kernel queues behind about half a second
        if held_back.first:
            torch.cuda._sleep(1_000_000_000)
            held_back.first = False
        launch(*args)

    dev = torch.device("cuda")
    x = torch.from_numpy(TokenStream.from_spec(SPEC).batch(0)).to(dev, dtype=torch.long)
    results = []
    for overlap in (False, True):
        model = _model(dev)
        opt = _master(model, overlap)
        assert (opt._side is not None) == overlap
        fn = make_loss_fn(model, dev, opt)
        torch.manual_seed(0)
        for name, leaf in opt.working().items():  # the same gradients for both runs
            leaf.grad = torch.randn_like(leaf) * 1e-2
        for p in model.parameters():
            if p not in opt._part:
                p.grad = torch.randn_like(p) * 1e-2
        held_back.first = overlap
        monkeypatch.setattr(master, "adamw_launch", held_back)
        opt.step(torch.ones((), device=dev), torch.ones((), dtype=torch.bool, device=dev))
        if overlap:
            assert not opt._side.query()  # the step returned with its updates still queued
        opt.zero_grad()
        # new tensors on the main stream: they would take the freed gradients' memory and
        # overwrite it before the held-back side stream read it, were it not recorded there
        junk = [torch.full_like(leaf, 1e3) for leaf in opt.working().values()]
        with torch.no_grad():
            loss = float(fn(model, x, SPEC.optim)[0])  # waits stage by stage
        opt.settle()
        results.append((loss, [p.detach().clone() for p in model.parameters()]))
        del junk
    (loss0, params0), (loss1, params1) = results
    for p, q in zip(params0, params1):
        assert torch.equal(p, q)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
