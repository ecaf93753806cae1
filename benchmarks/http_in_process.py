"""``bench_http.py``'s in-process side: the HTTP server's own start (its command line, checks and model), with rank 0
driving ``Server`` directly instead of serving HTTP: what the HTTP layer costs is the difference.

``python benchmarks/http_in_process.py [the server's options]`` builds the model and the ``Server`` as
``python -m metrale_model_engine.serve`` with those options does, warms it, prints ``ready``, then reads one JSON
workload a line from its standard input (``{"requests": [[prompt ids, new tokens], ...], "delays": [seconds,
...]}``: each request submitted that long after the start) and answers each with one JSON line: every request's
first-token and token times, from its submission, and the tokens generated.  An empty line ends it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from metrale_model_engine.demo import Work
from metrale_model_engine.reference import ReferenceLm, Request, Server
from metrale_model_engine.serve.process import HttpOptions, main, make_server

WARM_UP: Sequence[tuple[tuple[int, ...], int]] = tuple((tuple(range(1, 9 + i)), 8) for i in range(8))
"""The warm-up every side of the benchmark gets: 8 requests of 8 new tokens."""


def run(server: Server, requests: Sequence[tuple[Sequence[int], int]], delays: Sequence[float]) -> dict[str, Any]:
    """Submit each request (its id its index; ``server`` holds no other) at its delay, step until every one has
    ended; the times each token came, from its submission, and the wall time from the start to the last token."""
    times: dict[int, list[float]] = {index: [] for index in range(len(requests))}
    arrived: dict[int, float] = {}
    server.on_token = lambda request, _: times[request.id].append(time.perf_counter())
    order = sorted(range(len(requests)), key=lambda index: delays[index])
    started = time.perf_counter()
    while order or server.busy:
        now = time.perf_counter()
        while order and started + delays[order[0]] <= now:
            index = order.pop(0)
            prompt, new = requests[index]
            server.submit(Request(index, tuple(prompt), new))
            arrived[index] = now
        if server.busy:
            server.step()
        elif order:
            time.sleep(max(0.0, started + delays[order[0]] - time.perf_counter()))
    server.on_token = None
    ended = max(at for index in times for at in times[index])
    return {"times": [[at - arrived[index] for at in times[index]] for index in range(len(requests))],
            "wall_s": ended - started}  # fmt: skip


def drive(http: HttpOptions, model: ReferenceLm, work: Work, pids: Sequence[int]) -> None:
    """Rank 0: warm up, then run each workload read from standard input, each on a thread of its own.

    A thread, as the HTTP server steps ``Server`` on its scheduler's thread: torch's OpenMP threads behave
    differently under the main thread (on a busy 2-core machine, a run of the small model there was seen 10x
    slower than on another thread), and the comparison is of the HTTP layer alone.
    """
    server = make_server(model, work)
    answers: list[dict[str, Any]] = []

    def on_a_thread(requests: Sequence[tuple[Sequence[int], int]], delays: Sequence[float]) -> dict[str, Any]:
        thread = threading.Thread(target=lambda: answers.append(run(server, requests, delays)), name="scheduler")
        thread.start()
        thread.join()
        server.completions.clear()
        return answers.pop()

    on_a_thread(WARM_UP, [0.0] * len(WARM_UP))
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        asked = json.loads(line)
        print(json.dumps(on_a_thread(asked["requests"], asked["delays"])), flush=True)
    server.shutdown()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], head=drive))
