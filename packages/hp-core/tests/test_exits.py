"""hp.core.exits: a clean exit is judged finished or scaled out only on a membership read asked for after it."""

from __future__ import annotations

from hp.core.exits import CleanExits, Verdict


def test_a_rank_given_on_the_last_steps_is_not_taken_for_a_scale_out():
    # the race of elastic-shrink-on-kill: the last heartbeat (t=1) predates the grow that gave the joiner
    # spare.n2s0 a rank; it finished the loop and exited at t=2
    exits = CleanExits(elastic=True)
    exits.heard(set(), asked_at=1.0)
    assert exits.exited("spare.n2s0", at=2.0) is True  # ask now
    assert exits.verdict("spare.n2s0") is Verdict.PENDING  # not SCALED_OUT on the stale read
    exits.heard({"spare.n2s0"}, asked_at=2.5)
    assert exits.verdict("spare.n2s0") is Verdict.FINISHED


def test_a_scale_out_is_not_taken_for_a_finished_rank():
    exits = CleanExits(elastic=True)
    exits.heard({"w.2.0"}, asked_at=1.0)  # still a member when last asked
    exits.exited("w.2.0", at=2.0)  # the scale-out plan came after that read
    assert exits.verdict("w.2.0") is Verdict.PENDING
    exits.heard(set(), asked_at=3.0)
    assert exits.verdict("w.2.0") is Verdict.SCALED_OUT


def test_an_answer_to_an_older_request_does_not_replace_a_newer_one():
    exits = CleanExits(elastic=True)
    exits.exited("w.0.0", at=1.0)
    exits.heard({"w.0.0"}, asked_at=2.0)
    exits.heard(set(), asked_at=1.5)  # a slow answer, overtaken
    assert exits.verdict("w.0.0") is Verdict.FINISHED


def test_an_exit_seen_at_the_moment_of_the_read_waits_for_the_next():
    exits = CleanExits(elastic=True)
    exits.exited("w.0.0", at=2.0)
    exits.heard({"w.0.0"}, asked_at=2.0)
    assert exits.verdict("w.0.0") is Verdict.PENDING
    assert exits.verdict("never.seen") is Verdict.PENDING


def test_a_fixed_size_job_needs_no_read():
    exits = CleanExits(elastic=False)
    assert exits.exited("w.0.0", at=1.0) is False
    assert exits.verdict("w.0.0") is Verdict.FINISHED
