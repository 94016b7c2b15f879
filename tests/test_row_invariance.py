"""tools/row_invariance.py, the command behind kernels/linear.py's BLAS settings: under the settings
linear.py makes, no row count changes a row's bits (float32 and bfloat16), and it writes its JSON."""

from __future__ import annotations

import json

from tools import row_invariance


def test_our_settings_keep_every_row_the_same_bits_and_the_report_is_written(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert row_invariance.main(["--json", str(out), "--shapes", "1536x576", "--max-rows", "20"]) == 0
    report = json.loads(out.read_text())
    assert report["cpu"] and set(report["settings"]) == {f"{d}: {label}" for d, (_, values) in
                                                         row_invariance.SETTINGS.items() for label in values}
    for name, setting in report["settings"].items():
        row = setting["shapes"]["1536x576"]
        assert set(row["us_per_call"]) == {str(m) for m in row_invariance.ROWS}
        assert all(v > 0 for v in row["us_per_call"].values())
        if "ours" in name:
            assert row["rows_that_differ"] == [], name
    assert "wrote" in capsys.readouterr().out
