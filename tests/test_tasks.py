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


def test_weights_progress_is_said_in_a_unit_that_shows_it(monkeypatch):
    """A fetch's progress line: GiB for a real checkpoint, MiB below a tenth of one (the
    simulated fleet's checkpoint read "0.00 GiB of ~0.00 GiB")."""
    from sparkfleet import remote, weights

    said = {"n": "0"}
    monkeypatch.setattr(remote, "run", lambda target, command: remote.Result(True, [said["n"]], []))
    small = weights._progress("acme/tiny", "/hf", 4.3 / 1024)
    said["n"] = str(3 * 2**20)
    assert small(None) == "acme/tiny: 3.0 MiB of ~4.3 MiB (70%)"
    big = weights._progress("acme/big", "/hf", 70.5)
    said["n"] = str(35 * 2**30)
    assert big(None) == "acme/big: 35.00 GiB of ~70.50 GiB (50%)"
    said["n"] = "du: cannot access"
    assert big(None) == "acme/big: 0.0 MiB of ~70.50 GiB (0%)"
    assert weights._progress("acme/unknown", "/hf", 0.0)(None) == "acme/unknown: 0.0 MiB"
