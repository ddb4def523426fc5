from engines.epochs import repeat_warning, spec_epochs
from ladder.presets import micro_spec


def _spec(tmp_path, repeat: int):
    p = tmp_path / "t.txt"
    if not p.exists():
        p.write_text("x" * (65 * 8 * 20))  # 20 steps' worth of windows, a little less after the held-out tail
    return micro_spec(**{"data.sources": [{"name": "t", "weight": 1.0, "paths": [str(p)]}],
                         "data.total_tokens": 64 * 8 * 10 * repeat})


def test_epochs_come_from_the_prepared_shards_or_an_estimate_that_says_so(tmp_path):
    est = spec_epochs(_spec(tmp_path, 1))
    assert est["basis"] == {"t": "estimate"} and 0.4 < est["epochs"]["t"] < 0.6
    from engines.data import TokenStream

    TokenStream.from_spec(_spec(tmp_path, 1))
    exact = spec_epochs(_spec(tmp_path, 1))
    assert exact["basis"] == {"t": "shards"} and abs(exact["epochs"]["t"] - est["epochs"]["t"]) < 0.05


def test_a_forecast_warning_names_a_rung_that_repeated_its_data(tmp_path):
    assert repeat_warning(_spec(tmp_path, 1)) is None
    msg = repeat_warning(_spec(tmp_path, 4))
    assert msg.startswith("rung micro repeated its data (t 2.") and "memorisation" in msg
