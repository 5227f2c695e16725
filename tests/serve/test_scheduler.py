"""The scheduler without HTTP: one step per job per round in admission order, admission limits,
cancellation, failure isolation; a GenerationJob stepping the shared generation driver one
chunk or token a turn; batched steps capped at `prefill_tokens` prompt tokens."""

from __future__ import annotations

import threading
import time

import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError, QueueFullError
from cfr_atlas.generate import DEFAULT_CHUNK
from cfr_atlas.sampling import SamplingParams
from cfr_atlas.serve.jobs import GenerationJob, GenerationSpec, Job
from cfr_atlas.serve.scheduler import Scheduler
from cfr_atlas.validate import validation_text

LONG_PROMPT = validation_text()[:1500]  # several prefill chunks of the tiny model


class FakeChannel:
    def __init__(self):
        self.events = []
        self.cancelled = threading.Event()

    def put(self, kind, value):
        self.events.append((kind, value))


class CountingJob(Job):
    """Takes `n` steps, appending its name to a shared log; optionally fails at step `fail`."""

    def __init__(self, name, n, log, fail=None, gate=None):
        super().__init__(FakeChannel())
        self.name, self.n, self.log, self.fail, self.gate = name, n, log, fail, gate
        self.released = 0

    def absorb(self, result, seconds):
        assert result is None  # it plans no model work
        if self.gate is not None:
            self.gate.wait(5)
        self.log.append(self.name)
        if len([x for x in self.log if x == self.name]) == self.fail:
            raise ConfigError("fake", "failed on purpose")
        return self.log.count(self.name) == self.n

    def release(self):
        self.released += 1


def wait_idle(s: Scheduler, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = s.stats()
        if st.active == 0 and st.queued == 0 and st.submitted == (
                st.completed + st.failed + st.cancelled):
            return st
        time.sleep(0.005)
    raise AssertionError(s.stats())


def test_round_robin_release_and_failure_isolation():
    s, log, gate = Scheduler(max_active=3, max_queue=8), [], threading.Event()
    jobs = [CountingJob("a", 3, log, gate=gate), CountingJob("b", 2, log),
            CountingJob("c", 3, log, fail=2), CountingJob("d", 1, log)]
    for job in jobs:
        s.submit(job)
    s.start()
    gate.set()
    st = wait_idle(s)
    s.stop()
    # a, b, c admitted together (limit 3), stepped in turn; c fails on its 2nd step, its slot
    # goes to d at the next round
    assert log == ["a", "b", "c", "a", "b", "c", "a", "d"]
    assert [j.released for j in jobs] == [1, 1, 1, 1]
    assert jobs[2].channel.events[-1][0] == "error"
    assert st.completed == 3 and st.failed == 1


def test_queue_limit_and_cancel_while_waiting():
    s, log = Scheduler(max_active=1, max_queue=2, retry_after=3), []
    jobs = [CountingJob(str(i), 1, log) for i in range(2)]
    for job in jobs:
        s.submit(job)
    with pytest.raises(QueueFullError) as e:
        s.submit(CountingJob("x", 1, log))
    assert e.value.retry_after == 3 and "limit 2" in str(e.value)
    s.cancel(jobs[0])  # still waiting: dropped at once, never stepped nor released
    st = s.stats()
    assert st.queued == 1 and st.cancelled == 1 and st.rejected == 1
    s.start()
    wait_idle(s)
    s.stop()
    assert log == ["1"] and jobs[0].released == 0


def test_cancel_active_job_releases_it():
    s, log = Scheduler(max_active=2, max_queue=2), []
    forever = CountingJob("f", 10**9, log)
    s.start()
    s.submit(forever)
    while not log:
        time.sleep(0.001)
    s.cancel(forever)
    st = wait_idle(s)
    s.stop()
    assert forever.released == 1 and st.cancelled == 1


def test_generation_job_steps_the_shared_driver(reference):
    """A GenerationJob's events are the driver's: one prefill chunk per turn, then one token
    per turn; the joined text is `Model.generate`'s and the outcome counts its tokens."""
    ids = reference.tokenize(LONG_PROMPT)
    n_chunks = -(-len(ids) // DEFAULT_CHUNK)
    spec = GenerationSpec(tuple(ids), SamplingParams(repeat_penalty=1.1), 6, ("xyz",))
    job, turns, done = GenerationJob(reference, spec, FakeChannel()), 0, False
    while not done:
        done, turns = job.step(), turns + 1
        assert job.token_counts() == (min(turns * DEFAULT_CHUNK, len(ids)),
                                      max(0, turns - n_chunks + 1))
    job.release()
    kinds = [kind for kind, _ in job.channel.events]
    assert kinds[-1] == "done" and kinds.count("done") == 1
    outcome = job.channel.events[-1][1]
    assert turns == n_chunks + outcome.eval_count - 1  # the last chunk samples the first
    text = "".join(v for kind, v in job.channel.events if kind == "text")
    assert text == reference.generate(ids, max_tokens=6, repeat_penalty=1.1, stop=["xyz"])
    assert outcome.eval_count == reference.last_telemetry["generated_tokens"]
    assert outcome.telemetry["logits_sha256"] == reference.last_telemetry["logits_sha256"]
    assert outcome.prompt_seconds == outcome.telemetry["prefill_seconds"] > 0
    assert outcome.eval_seconds == outcome.telemetry["decode_seconds"] > 0


def test_a_batched_step_caps_prompt_tokens_and_keeps_decoding(tiny_llama):
    """A long prompt arriving while another sequence decodes: every pass carries the decoding
    sequence's token plus at most `prefill_tokens` prompt tokens, and both results equal their
    solo runs."""
    model = load_model(tiny_llama)
    passes, real = [], model.net.forward_batch

    def recording(items):
        passes.append([len(item.ids) for item in items])
        return real(items)

    model.net.forward_batch = recording
    short, long = model.tokenize("hello world"), model.tokenize(LONG_PROMPT)
    specs = [GenerationSpec(tuple(short), SamplingParams(), 300),
             GenerationSpec(tuple(long), SamplingParams(temperature=0.9, seed=2), 5)]
    jobs = [GenerationJob(model, spec, FakeChannel()) for spec in specs]
    s = Scheduler(max_active=2, max_queue=2, prefill_tokens=100)
    s.start()
    s.submit(jobs[0])
    while not any(kind == "text" for kind, _ in jobs[0].channel.events):
        time.sleep(0.001)  # the short one decodes before the long one arrives
    s.submit(jobs[1])
    wait_idle(s, timeout=300)
    s.stop()
    prefill = [p for p in passes if len(p) == 2 and p[1] > 1]  # the long prompt's chunks
    assert len(prefill) >= len(long) // 100 and all(p[0] == 1 and p[1] <= 100 for p in prefill)
    assert all(sum(p) <= 100 + len(p) for p in passes)
    texts = ["".join(v for kind, v in job.channel.events if kind == "text") for job in jobs]
    model.net.forward_batch = real
    assert texts[0] == model.generate(short, max_tokens=300)
    assert texts[1] == model.generate(long, max_tokens=5, temperature=0.9, seed=2)
    st = s.stats()
    assert st.batch_sizes.count == st.steps == len(passes)
    assert st.queue_seconds.count == 2 and st.completed == 2
