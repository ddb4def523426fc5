"""ladder/local.local_gpus: the CUDA devices a process here would see, counted without torch."""

import torch

from ladder.local import local_gpus


def _driver(tmp_path, n):
    d = tmp_path / "gpus"
    for i in range(n):
        (d / f"0000:{i:02x}:00.0").mkdir(parents=True)
    return d


def test_the_drivers_gpus_are_counted_and_cut_to_cuda_visible_devices(tmp_path):
    d = _driver(tmp_path, 4)
    assert local_gpus(d, {}) == 4
    assert local_gpus(d, {"CUDA_VISIBLE_DEVICES": "1,3"}) == 2
    assert local_gpus(d, {"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1  # CUDA stops at a negative entry
    assert local_gpus(d, {"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert local_gpus(d, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}) == 4  # no more than the driver has


def test_this_machine_counts_the_devices_torch_sees():
    assert local_gpus() == torch.cuda.device_count()
