"""How a detached step's journal is read (sparkfleet.tasks)."""

from __future__ import annotations

from sparkfleet.tasks import REPORT_PREFIX, _lines


def test_a_report_printed_after_a_progress_bar_is_still_a_report():
    journal = ["Fetching 5 files:  60%|######    | 3/5 [00:04<00:02]\rreport: acme/tiny from http://a failed (X): "
               "fetching from http://b", "complete: acme/tiny@1 (0.00 GiB) in 9 s"]
    assert [line for line in _lines(journal) if line.startswith(REPORT_PREFIX)] == [
        "report: acme/tiny from http://a failed (X): fetching from http://b"]
    # As the journal of a host had it: behind the bar's last draw, no \r between.
    drawn = ["Fetching 5 files:  80%|########  | 4/5 [00:22<00:05,  5.70s/it]report: z from http://a failed (ReadError): "
             "fetching from http://b", "a line that quotes report: inside it"]
    assert _lines(drawn) == ["report: z from http://a failed (ReadError): fetching from http://b", drawn[1]]
