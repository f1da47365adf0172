"""analyzers/health.py on hand-made health tables whose answers are worked out by hand: the robust test's z, a NaN
kept out of the window, the causes it names, and which replica a fingerprint vote names."""
import math

import numpy as np
import pandas as pd

from dtprof.analyzers import health

COLS = ["rank", "step", "loss", "grad_norm", "lr", "lrs", "nonfinite", "param_fp"]


def table(rows) -> pd.DataFrame:
    df = pd.DataFrame([dict(zip(COLS, r)) for r in rows], columns=COLS)
    df["param_fp"] = df["param_fp"].astype("Int64")
    return df


def series(rank, losses, norms=None, lrs=None, fps=None):
    out = []
    for s, x in enumerate(losses):
        bad = "loss" if x is not None and not math.isfinite(x) else ""
        out.append((rank, s, None if bad else x, None if norms is None else norms[s], 0.1 if lrs is None else lrs[s],
                    None, bad, None if fps is None else fps[s]))
    return out


def test_robust_z_by_hand():
    # a series with negative values is tested as it is: window -10..-1 has median -5.5 and MAD 2.5, so x = 14 has
    # z = (14 + 5.5) / (1.4826 * 2.5) = 5.26: not a spike (< 8); x = 25 has z = 30.5 / 3.7065 = 8.23: a spike
    z = health.outliers(np.array([-10, -9, -8, -7, -6, -5, -4, -3, -2, -1, 14.0]))
    assert np.isnan(z[:8]).all() and math.isclose(z[10], 19.5 / (1.4826 * 2.5))
    assert health.outliers(np.array([-10, -9, -8, -7, -6, -5, -4, -3, -2, -1, 25.0]))[10] > health.SPIKE_Z
    # a positive one on its logarithms: window 1, 2, 4, ..., 512 (log2: 0..9, median 4.5, MAD 2.5), so x = 2^24
    # has z = (24 - 4.5) / (1.4826 * 2.5) = 5.26 (in log2 units: the ratio is the same in any base)
    z = health.outliers(np.array([2.0 ** k for k in range(10)] + [2.0 ** 24]))
    assert math.isclose(z[10], 19.5 / (1.4826 * 2.5))


def test_nan_is_kept_out_of_the_window_and_named_on_its_rank():
    clean = [1.0 + 0.01 * (s % 3) for s in range(20)]
    r1 = list(clean)
    r1[12] = float("nan")
    h = table(series(0, clean) + series(1, r1))
    block = health.analyze_health(h)
    assert block["first_nonfinite"] == {"step": 12, "ranks": [1], "what": "local loss"}
    assert [i["kind"] for i in block["incidents"]] == ["nonfinite"]      # no spike from the NaN's neighbours


def test_nan_between_reads_is_bounded_and_names_no_rank_once_it_spread():
    # the loss read at steps 0-9, then every 8th step (the numerics part's priced reads): rank 2's NaN at step 11
    # reached every rank by step 16, the first read after it (step 12's row holds a fingerprint alone)
    steps = list(range(10)) + [12, 16]
    rows = [(r, s, None if s >= 12 else 1.0, None, 0.1, None, "loss" if s == 16 else "", 7 if s == 12 else None)
            for r in range(3) for s in steps]
    block = health.analyze_health(table(rows))
    assert block["first_nonfinite"] == {"step": 16, "ranks": [0, 1, 2], "what": "local loss", "since_step": 10}
    (inc,) = block["incidents"]
    assert inc["ranks"] == [] and "between steps 10 and 16" in inc["message"]
    # read at every step: the rank is named and no range given
    rows = [(r, s, None if s == 16 and r == 2 else 1.0, None, 0.1, None, "loss" if s == 16 and r == 2 else "",
             None) for r in range(3) for s in range(17)]
    (inc,) = health.analyze_health(table(rows))["incidents"]
    assert inc["ranks"] == [2] and "first at step 16" in inc["message"]


def test_spike_causes_lr_and_one_ranks_data():
    base = [2.0 + 0.02 * (s % 5) for s in range(30)]
    lr = [0.1] * 30
    lr[19] = 100.0                      # the update before step 20
    spike = list(base)
    spike[20] = 50.0
    block = health.analyze_health(table(series(0, spike, norms=[1.0] * 30, lrs=lr) + series(1, base, lrs=lr)))
    (inc,) = block["incidents"]
    assert (inc["kind"], inc["step"], inc["ranks"]) == ("loss_spike", 20, [0])
    assert inc["cause"].startswith("the learning rate changed: 100 at step 19")
    assert "only rank 0's loss jumped" in inc["cause"]
    block = health.analyze_health(table(series(0, spike, norms=[1.0] * 30) + series(1, base)))
    assert "the gradient norm is normal: the data" in block["incidents"][0]["cause"]


def test_fingerprint_vote_names_the_odd_replica_or_both_of_two():
    groups = pd.DataFrame({"rank": [0, 1, 2], "group": ["0"] * 3, "ranks": ["0,1,2"] * 3})
    coll = pd.DataFrame({"rank": [0, 1, 2], "source": ["ddp"] * 3, "group": ["0"] * 3})
    fps = {0: [5, 7, 9, 11], 1: [5, 7, 9, 11], 2: [5, 7, 10, 12]}
    rows = [r for k, v in fps.items() for r in series(k, [1.0] * 4, fps=v)]
    block = health.analyze_health(table(rows), None, coll, groups)
    (inc,) = block["incidents"]
    assert (inc["kind"], inc["step"], inc["ranks"]) == ("divergence", 2, [2])
    assert block["fingerprint"]["compared"] == 4 and block["fingerprint"]["replica_groups"] == [[0, 1, 2]]
    two = table([r for k in (0, 2) for r in series(k, [1.0] * 4, fps=fps[k])])
    inc = health.analyze_health(two, None, coll, groups)["incidents"][0]
    assert inc["ranks"] == [0, 2] and "cannot be told" in inc["message"]
    # rank 0 priced a longer interval (steps 0, 4), ranks 1 and 2 a shorter one (0, 2, 4): rank 2's bit flipped
    # before step 2, where only two replicas compare (no majority); step 4's three name rank 2, diverged by step 2
    five = {0: [5, 7, 9, 11, 13], 1: [5, 7, 9, 11, 13], 2: [5, 7, 10, 12, 14]}
    every = {0: 4, 1: 2, 2: 2}
    sparse = table([r for k, v in five.items() for r in series(k, [1.0] * 5, fps=v) if r[1] % every[k] == 0])
    (inc,) = health.analyze_health(sparse, None, coll, groups)["incidents"]
    assert (inc["step"], inc["ranks"]) == (2, [2]) and "other 2 replica(s)" in inc["message"], inc
    # without DDP's collectives the ranks are not known to be replicas: nothing is compared
    assert health.analyze_health(table(rows), None, coll.assign(source="user"), groups)["incidents"] == []


def test_a_grown_loss_scale_is_not_a_loss_spike_and_a_skipped_step_not_an_incident():
    """A GradScaler's loss is recorded as scaled: its scale doubling at step 30 doubles every later loss, which the
    spike test must not read as a jump (it tests the loss divided by the scale); a step the scaler skipped (its
    loss inf) is named under health.scaler, not as a non-finite incident. The same series without the scale
    columns does raise the spike (the test can fail)."""
    rows = []
    for step in range(60):
        scale = 1024.0 * (2 if step >= 30 else 1)
        loss = (1.0 + 0.01 * ((step * 7) % 5)) * scale
        rows.append({"rank": 0, "step": step, "loss": math.inf if step == 45 else loss, "grad_norm": None,
                     "lr": 0.1, "lrs": None, "nonfinite": "loss" if step == 45 else "", "param_fp": None,
                     "grad_norm_source": "", "loss_scale": scale, "scaler_skips": int(step == 45)})
    h = pd.DataFrame(rows)
    h["loss"] = h["loss"].where(h["nonfinite"] == "")
    block = health.analyze_health(h)
    assert block["incidents"] == [] and block["first_nonfinite"] is None
    assert block["scaler"]["skipped_steps"] == [{"step": 45, "ranks": [0], "skips": 1}]
    assert (block["scaler"]["loss_scale_min"], block["scaler"]["loss_scale_max"]) == (1024.0, 2048.0)
    bare = health.analyze_health(h.drop(columns=["loss_scale", "scaler_skips"]))
    assert [(i["kind"], i["step"]) for i in bare["incidents"]][:2] == [("loss_spike", 30), ("nonfinite", 45)]
