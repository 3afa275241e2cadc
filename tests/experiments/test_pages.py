"""Result pages that say what their rows show (issue 53): a page's header is its run's
(date, machine, commit from protocol.json), never the regenerating machine's; the committed
numeric-task page regenerates from its raw rows to the byte; sentences a page generates
follow their rows; the hand-written sentences of docs/results.md quote the numbers
`experiments.claims` recomputes from the committed rows; the summary opens the page."""

from __future__ import annotations

import contextlib
import io
import json

from experiments import claims, results_page
from experiments.continuations import report as cont
from experiments.numeric_tasks import report as nt

from ..distributed.launcher import ROOT

RESULTS = ROOT / "docs" / "results"


def test_the_committed_numeric_task_page_is_its_runs_and_regenerates_to_the_byte(tmp_path):
    committed = RESULTS / "numeric-tasks"
    recorded = json.loads((committed / "protocol.json").read_text())
    assert nt.main([str(committed / "raw_runs.jsonl"), "--out", str(tmp_path)]) == 0
    page = (tmp_path / "report.md").read_text()
    assert page == (committed / "report.md").read_text()
    header = page.splitlines()[2]
    assert f", {recorded['date']}, " in header and recorded["machine"] in header
    assert recorded["date"] == "2026-12-01" and "AMD EPYC" in recorded["machine"]


def test_a_numeric_task_header_is_read_from_protocol_json_not_the_machine(tmp_path):
    from .test_numeric_tasks import fake_metrics

    runs = [fake_metrics(kind, seed) for kind in ("mle", "del") for seed in (1, 2, 3)]
    out = tmp_path / "run"
    nt.write_report(runs, out, protocol={}, command="cmd", minutes=3.0)
    recorded = json.loads((out / "protocol.json").read_text())
    assert {"date", "machine", "commit"} <= recorded.keys()  # recorded when the run ends
    recorded.update(date="1999-01-02", machine="a slide rule", commit="c0ffee")
    (out / "protocol.json").write_text(json.dumps(recorded))
    again = tmp_path / "again"
    assert nt.main([str(out / "raw_runs.jsonl"), "--out", str(again)]) == 0
    header = (again / "report.md").read_text().splitlines()[2]
    assert header == "`cmd`, 1999-01-02, 3 minutes on a slide rule, commit c0ffee."


def _train_rows(ce_shift: float) -> list[dict]:
    rows = []
    for seed in (1, 2, 3, 4):
        for kind, shift in (("mle", 0.0), ("del-1", ce_shift)):
            rows.append(
                {
                    "kind": kind,
                    "task": "_train",
                    "seed": seed,
                    "step": 300,
                    "ce": 0.8 + seed / 100 + shift + (seed % 2) / 1000,
                    "digit_entropy": 1.6 + seed / 100,
                    "numeric_grad_share": 0.2,
                    "numeric_grad_cos": -0.3,
                }
            )
    return rows


def test_the_escape_sentence_follows_its_rows():
    table, said = cont.escape_table(_train_rows(0.0))
    assert "0 of 2 paired intervals" in said and "none of the DEL arms'" in said
    table, said = cont.escape_table(_train_rows(0.05))
    assert "1 of 2 paired intervals" in said
    assert "the escape does not leave CE and the digit entropy where MLE leaves them" in said
    assert "| del-1 | +0.050 [" in table and "| -0.300 |" in table


def test_the_results_pages_sentences_quote_the_numbers_of_the_rows():
    """Each corrected sentence of docs/results.md against the line of `experiments.claims`
    that recomputes its number from the committed raw rows."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert claims.main() == 0
    said = printed.getvalue()
    page = " ".join((ROOT / "docs" / "results.md").read_text().split())
    pairs = [  # (in the claims' output, in the page)
        (
            "multiply digit accuracy: -0.0395 per decade, detectable ±0.0346: above",
            "multiply's (−0.0395) is above its detectable 0.0346",
        ),
        ("placebo intervals excluding 0: 6 of 48", "6 of its 48 (6 metrics × 8 tasks)"),
        ("4 of 8 tasks (add, convert, noisy, subtract)", "on 4 of 8 tasks (add, convert"),
        (
            "subtract entropy gap, mean over alpha: +0.066 [+0.019, +0.114]",
            "+0.066 [+0.019, +0.114] nats on subtract",
        ),
        (
            "multiply entropy gap, mean over alpha: +0.065 [+0.031, +0.099]",
            "+0.065 [+0.031, +0.099] on multiply",
        ),
        (
            "del-0.1 minus mle, training ce at step 300: +0.007 [+0.002, +0.013]",
            "+0.007 [+0.002, +0.013] at α = 0.1",
        ),
        (
            "del-3 minus mle, training digit_entropy at step 300: +0.145 [+0.026, +0.264]",
            "+0.145 [+0.026, +0.264]",
        ),
        (
            "del-0.1 at step 300: the term's share of the logit gradient 0.045, its cosine with "
            "CE's +0.131",
            "4.5% (α = 0.1)",
        ),
        (
            "del-3 at step 300: the term's share of the logit gradient 0.505, its cosine with "
            "CE's -0.458",
            "−0.46 at α = 0.1, 0.3, 1 and 3",
        ),
        ("copy: seed correlation of MLE and DEL digit accuracy +0.99", "+0.99 on copy"),
        ("convert: seed correlation of MLE and DEL digit accuracy +0.81", "+0.81 on convert"),
        ("(4.0x)", "4.0×"),
        (
            "dist2: entropy-gap difference to MLE of the same sign in both runs on 6 of 8",
            "DIST2's on 6 of 8",
        ),
        (
            "ntl_was: entropy-gap difference to MLE of the same sign in both runs on 8 of 8",
            "NTL-WAS's sign agrees on 8 of 8",
        ),
        (
            "dist2 minus mle, digit entropy: +0.0336 = +2.2 pooled SD, Welch p 0.057",
            "DIST2's (+2.2 SD, p 0.057)",
        ),
        (
            "del minus mle, digit entropy: +0.0195 = +1.3 pooled SD, Welch p 0.176",
            "DEL's (+1.3 SD, p 0.18)",
        ),
        ("del minus mle, loss: +0.0159 = +1.6 pooled SD, Welch p 0.168", "(Welch p 0.17"),
        ("primary trends surviving Holm without alpha = 3: 1 of 7", "without α = 3 only 1 of"),
        ("primary trends surviving Holm per base (df 3): 3 of 7", "keeps 3 of 7"),
        (
            "del-0.1 minus mle, digit accuracy at step 300: a +0.025 gain ruled out on 7 of 8",
            "a +0.025 gain on 7 of 8 tasks",
        ),
        (
            "del-0.1 minus mle, digit accuracy at step 300: a +0.025 gain ruled out on 7 of 8 "
            "tasks, a -0.025 loss on 6; highest upper end +0.054",
            "exclude a gain of +0.025 on 7 of 8 tasks (subtract's reaches +0.054)",
        ),
    ]
    for number, sentence in pairs:
        assert number in said, number
        assert sentence in page, sentence
    for stale in (
        "several standard deviations",
        "barely helps",
        "the same signs and sizes",
        "the p̂-weighted BCE itself widens",
        "at or below it and survive",
    ):
        assert stale not in page, stale


def test_the_summary_opens_the_results_page(tmp_path):
    summary, notes, comparison = tmp_path / "s.md", tmp_path / "n.md", tmp_path / "c.md"
    summary.write_text("## Summary\n\n| kind | supports |\n")
    notes.write_text("## Notes\n")
    comparison.write_text("| run | n |\n")
    out = tmp_path / "results.md"
    arguments = [str(comparison), str(out), "--plots", str(tmp_path), "--minutes", "1"]
    arguments += ["--steps", "2", "--seeds", "3", "--notes", str(notes), "--command", "x"]
    assert results_page.main([*arguments, "--summary", str(summary)]) == 0
    lines = out.read_text().splitlines()
    assert lines[2] == "## Summary" and lines.index("## The loss comparison") > 2
    committed = (ROOT / "docs" / "results.md").read_text()
    assert (ROOT / "launch/experiments/results_summary.md").read_text().strip() in committed
    assert committed.endswith((ROOT / "launch/experiments/compare_losses.notes.md").read_text())
