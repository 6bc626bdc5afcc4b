"""The profile's timeline, profile.trace.json: Chrome's trace-event format (what PyTorch's
export_chrome_trace writes), which Perfetto (https://ui.perfetto.dev) and chrome://tracing open.

One process per rank (pid = the rank, named 'rank R (device)'). On its first track (tid 0), each
profiled step is a span 'step N' holding the step's spans as the profiler recorded them, nested:
every module's forward and backward, the loss, the optimizer step, the batch gather, ... and, on
the CPU, each gradient bucket's all-reduce inside the backward it blocks. Concurrent spans (a
bucket's all-reduce on a GPU) go on a track per stream, so that their overlap with the backward
shows. Times are the profiler's marks (CUDA events on the GPU, the wall clock on the CPU), from the
origin taken before the first profiled step; with several ranks, each rank takes it right after a
barrier, so that all ranks' steps lie on one timeline (to the barrier's skew), and rank 0 holds
every rank's events."""
import json

from .measure import UNTRACKED, label

STEP_TRACK = 0


def rank_events(profiled, kinds, rank, device):
    """The trace events of this rank's profiled steps (StepTimes): the names of its process and
    tracks ("M" events), then a complete event ("X") per span. ``kinds``: the Profiler's module
    class by row key, for the modules' events."""
    events = [_metadata("process_name", rank, STEP_TRACK, f"rank {rank} ({device})"),
              _metadata("thread_name", rank, STEP_TRACK, "training step")]
    tracks = {}     # a concurrent span's stream -> its track
    for number, step in enumerate(profiled):
        for span in step.spans:
            track = STEP_TRACK
            if span.concurrent:
                if span.stream not in tracks:
                    tracks[span.stream] = len(tracks) + 1
                    events.append(_metadata("thread_name", rank, tracks[span.stream], f"{span.key[1]} stream"))
                track = tracks[span.stream]
            events.append(_complete(span, number, kinds.get(span.key), rank, track))
    return events


def gathered(events, comm):
    """Every rank's events, in rank order, on every rank: a collective that each rank calls."""
    return [event for part in comm.all_gather_bytes(json.dumps(events).encode()) for event in json.loads(part)]


def document(events):
    """The JSON object of profile.trace.json."""
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata(kind, pid, tid, name):
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def _complete(span, step, kind, pid, tid):
    """A span as an "X" event: microseconds, rounded to the nanosecond; named by its row and, in
    the forward or backward, its phase (a module runs in both), the step's own key as 'step N'."""
    name, category = span.key
    if span.key == UNTRACKED:
        title, category = f"step {step}", "step"
    else:
        title = label(name) if span.phase == "other" else f"{label(name)} {span.phase}"
    begin, end = round(span.begin_ms * 1e3, 3), round(span.end_ms * 1e3, 3)
    args = {"step": step, "phase": span.phase, **({"type": kind} if kind else {})}
    return {"name": title, "cat": category, "ph": "X", "ts": begin, "dur": round(end - begin, 3),
            "pid": pid, "tid": tid, "args": args}
