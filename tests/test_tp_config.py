"""`parallelism.tp` refusals, one line each with exit 2, checked through the command line's dry run (torch's
fake process group: no process is launched, nothing is trained). Heads, kv heads, the FFN width and the
sequence go through one check (`distributed.tp.check_divisible`): the kv heads case stands for them."""

from __future__ import annotations

import pytest

from tests.test_cli import _run


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["--parallelism.tp", "4", "--model.n_kv_heads", "2"], "model.n_kv_heads = 2 does not divide by"),
    ],
)
def test_heads_that_tp_does_not_divide_are_refused_in_one_line(tmp_path, overrides, expected):
    result = _run(["--config", "llama3_debug", "--dry-run", *overrides], tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr
