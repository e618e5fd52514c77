"""A request's phases from the engine's recorded times, against hand-laid timelines."""

from llmctl.serve.api.timeline import Phase, request_phases
from llmctl.serve.engine.outputs import RequestMetrics


def _spans(phases):
    return [(p.name, p.start, p.end) for p in phases]


def test_finished_request_tiles_arrival_to_finish():
    # arrival 10, scheduled 11 (chunk of 256), chunk of 88 at 12, first token 12.5,
    # preempted at 13 while decoding, finished 15
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=11.0, first_token_time=12.5,
                       finish_time=15.0, prefill_chunks=((11.0, 256), (12.0, 88)),
                       preemption_times=(13.0,))
    phases = request_phases(m, end=99.0)
    assert _spans(phases) == [("queue", 10.0, 11.0), ("prefill", 11.0, 12.5),
                              ("prefill_chunk", 11.0, 12.0), ("prefill_chunk", 12.0, 12.5),
                              ("decode", 12.5, 15.0)]
    prefill = phases[1]
    assert prefill.tokens == 344 and prefill.parent is None
    assert [(c.index, c.tokens, c.parent) for c in phases[2:4]] == [(0, 256, "prefill"),
                                                                     (1, 88, "prefill")]
    assert phases[-1].events == (("preempted", 13.0),)
    assert all(p.events == () for p in phases[:-1])
    assert m.num_preemptions == 1


def test_preemption_during_prefill_is_an_event_of_the_prefill():
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=1.0, first_token_time=4.0,
                       finish_time=5.0, prefill_chunks=((1.0, 16), (3.0, 16)),
                       preemption_times=(2.0,))
    prefill = next(p for p in request_phases(m, 9.0) if p.name == "prefill")
    assert prefill.events == (("preempted", 2.0),)
    assert prefill.tokens == 32  # recomputed tokens are computed tokens


def test_request_aborted_in_prefill_ends_its_open_phase_at_end():
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=2.0, prefill_chunks=((2.0, 8),))
    assert _spans(request_phases(m, end=7.0)) == [("queue", 0.0, 2.0), ("prefill", 2.0, 7.0),
                                                   ("prefill_chunk", 2.0, 7.0)]


def test_request_never_scheduled_is_all_queue():
    m = RequestMetrics(arrival_time=3.0)
    assert request_phases(m, end=4.5) == [Phase("queue", 3.0, 4.5)]


def test_clock_skew_never_makes_a_negative_span():
    # finish recorded (engine thread) a hair before the first token time it reports
    m = RequestMetrics(arrival_time=0.0, first_scheduled_time=1.0, first_token_time=2.0,
                       finish_time=1.9999)
    decode = request_phases(m, 5.0)[-1]
    assert decode.name == "decode" and decode.end == decode.start == 2.0
