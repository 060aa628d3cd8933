"""experiments/: the plot tool's averaging over seeds on hand-made event files, and every claim's
experiment end to end on its smoke setting (2 iterations, 1 seed), down to its PNG and table."""

import os

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from experiments import claims, plot


def write_events(folder, values, tag="charts/reward_mean", start=0):
    writer = SummaryWriter(folder)
    for step, value in enumerate(values, start):
        writer.add_scalar(tag, value, step)
    writer.close()


def test_runs_of_one_arm_are_averaged_with_a_band(tmp_path):
    write_events(tmp_path / "a_seed0" / "tb", [0.0, 1.0, 2.0, 3.0])
    write_events(tmp_path / "a_seed1" / "tb", [2.0, 3.0, 4.0])          # one step fewer: step 3 is left out
    write_events(tmp_path / "a_seed2" / "tb", [1.0, 5.0, 0.0, 7.0])
    write_events(tmp_path / "b" / "tb", [9.0, 8.0])
    runs = [tmp_path / d for d in ("a_seed0", "a_seed1", "a_seed2", "b")]
    curves = plot.arms(runs, ["charts/reward_mean"])
    assert list(curves) == ["a", "b"]
    steps, mean, std = curves["a"]["charts/reward_mean"]
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(mean, [1.0, 3.0, 2.0])
    np.testing.assert_allclose(std, [1.0, 2.0, 2.0])                    # Bessel: e.g. step 1: 1, 3, 5
    steps, mean, std = curves["b"]["charts/reward_mean"]
    assert mean.tolist() == [9.0, 8.0] and std.tolist() == [0.0, 0.0]
    plot.main([*map(str, runs), "--metric", "charts/reward_mean", "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no scalar charts/nothing"):
        plot.arms(runs, ["charts/nothing"])


def test_a_resumed_run_keeps_the_last_value_of_a_step(tmp_path):
    write_events(tmp_path / "r" / "tb", [1.0, 1.0, 1.0])
    write_events(tmp_path / "r" / "tb", [5.0, 6.0], start=1)           # the resumed half rewrote steps 1, 2
    assert plot.read_scalars(tmp_path / "r", ["charts/reward_mean"])["charts/reward_mean"] == {0: 1.0, 1: 5.0, 2: 6.0}


@pytest.mark.parametrize("name", list(claims.CLAIMS))
def test_every_claim_runs_end_to_end_on_its_smoke_setting(name, tmp_path):
    claims.main([name, "--smoke", "--out", str(tmp_path)])
    results = tmp_path / "results"
    assert (results / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (results / f"{name}.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(claims.CLAIMS[name].arms)
    assert "nan" not in table
    for arm in claims.CLAIMS[name].arms:
        assert os.path.isfile(tmp_path / "runs" / name / f"{arm}_seed0" / "iter_0001" / "metrics.json")
