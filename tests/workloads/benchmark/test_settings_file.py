"""A ``--settings`` file that is not a tuned-settings file is refused in one line naming it:
a JSON list ended in ``AttributeError: 'list' object has no attribute 'get'``, a row that is
not a table in a TypeError, and text that is not JSON in orjson's words without the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from talaria.cli import main
from workloads.benchmark.tuning import Tuned, load_settings, save_settings


@pytest.mark.parametrize("text", [
    "[1, 2]", "not json", '{"setup_key": "k"}', '{"rows": [1]}', '{"rows": {"talaria": 5}}',
    '{"rows": {}, "ideal": 3}', '{"rows": {"talaria": {"setting": []}}}',
])
def test_a_file_that_is_not_tuned_settings_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
) -> None:
    path = tmp_path / "settings.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="not a tuned-settings file") as exc:
        load_settings(None, path)
    assert str(path) in str(exc.value)
    assert main(["replay", "--suite", "off", "--policies", "talaria", "--max-sessions", "1",
                 "--no-progress", "--settings", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: not a tuned-settings file" in err[0], err


def test_a_saved_file_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    tuned = Tuned({"baseline": {"setting": {"slot_close": "drained", "slot_quantum_s": 60.0}}},
                  {})
    save_settings(tuned, "key", path)
    assert load_settings("key", path) == tuned
    assert load_settings("other", path) is None
    assert load_settings("key", tmp_path / "missing.json") is None
