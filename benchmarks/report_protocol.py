"""What the protocol benchmark prints and plots: tables, ratios measured in the one run, and every target."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from harness import Result

TOKEN_SIZES = (1, 128, 4_096, 65_536)
DECODE_WORDS = 137
GAP_LABELS = ("0.1 ms", "1 ms", "5 ms", "20 ms")


def print_report(
    found: list[Result], idle: list[dict[str, float]], meta: dict[str, object]
) -> tuple[dict[str, float], list[dict[str, object]]]:
    """Print every case, the gloo, shared-memory and decode tables, and the targets; return targets and rows."""
    by_name = {r.name: r for r in found}

    def med(name: str) -> float:
        return by_name[name].median_us

    def paired(name: str, other: str) -> float:
        return statistics.median(
            a / b for a, b in zip(by_name[name].samples_us, by_name[other].samples_us, strict=True)
        )

    print(
        f"\n{meta['backend']} x {meta['world_size']} ranks, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['rounds']} rounds x {meta['calls']} calls; medians (p25-p75), microseconds per call"
    )
    print(f"{'case':<52}{'latency':>9}{'':>18}{'head cost':>11}{'delivery':>10}")
    for result in sorted(found, key=lambda r: (r.family, r.kind, r.words, r.gap_s, r.name)):
        low, high = result.spread_us
        delivery = result.delivery_median_us
        print(f"{result.name:<52}{result.median_us:>9.1f}{f'({low:.1f}-{high:.1f})':>18}"
              f"{result.head_median_us:>11.2f}{f'{delivery:.1f}' if delivery >= 0 else 'n/a':>10}")  # fmt: skip
    print(
        "delivery: from the end of the head's call to the slowest worker holding the message; n/a where the\n"
        "head's call returns only after the workers have it (a gloo broadcast, a ring that waits for its readers)"
    )
    table: list[dict[str, object]] = []

    print(f"\n{'gloo case':<40}{'ours':>8}{'floor':>9}{'peer':>9}{'ours/floor':>12}{'paired':>9}{'ours/peer':>11}"
          f"{'ours/(count+floor)':>20}")  # fmt: skip
    rows: list[tuple[str, str, str, str | None]] = [
        (name, "floor 1 words", "peer object_list header", None) for name in ("header v1 (gloo)", "header v2 (gloo)")
    ]
    for n in TOKEN_SIZES:
        for how in ("from list", "from buffer", "buffer into buffer"):
            two = f"floor count+{n} words" if n > 1 else None
            rows.append((f"tokens {n} {how} (gloo)", f"floor {n} words", f"peer object_list tokens {n}", two))
    rows.append(
        ("decode step, one message (gloo)", f"floor {DECODE_WORDS} words", "peer object_list decode step", None)
    )
    rows.append(
        ("decode step, item by item (gloo)", f"floor {DECODE_WORDS} words", "peer object_list decode step", None)
    )
    for name, floor_name, peer_name, two_name in rows:
        ours, floor, peer = med(name), med(floor_name), med(peer_name)
        two_ratio = ours / med(two_name) if two_name else None
        print(f"{name:<40}{ours:>8.1f}{floor:>9.1f}{peer:>9.1f}{ours / floor:>11.2f}x{paired(name, floor_name):>8.2f}x"
              f"{ours / peer:>10.2f}x" + (f"{two_ratio:>19.2f}x" if two_ratio else ""))  # fmt: skip
        table.append({"case": name, "ours_us": ours, "floor_us": floor, "peer_us": peer,
                      "ours_over_floor": ours / floor, "paired_ours_over_floor": paired(name, floor_name),
                      "ours_over_peer": ours / peer, "ours_over_count_plus_floor": two_ratio})  # fmt: skip

    print(f"\n{'shm case':<40}{'ours':>8}{'gloo floor':>12}{'ring':>8}{'queue':>9}{'pipe':>9}{'ours/gloo':>11}"
          f"{'ring/ours':>11}{'queue/ours':>12}{'pipe/ours':>11}")  # fmt: skip
    rows2 = [("header v2 (shm)", "floor 2 words", "header")]
    for n in TOKEN_SIZES:
        rows2 += [(f"tokens {n} from list (shm)", f"floor {n} words", f"tokens {n}"),
                  (f"tokens {n} buffer into buffer (shm)", f"floor {n} words", f"tokens {n}")]  # fmt: skip
    for name, floor_name, peer_case in rows2:
        ours, floor = med(name), med(floor_name)
        ring = by_name.get(f"peer pickle ring {peer_case}")
        queue, pipe = med(f"peer queue {peer_case}"), med(f"peer pipe {peer_case}")
        if "into" in name:
            pipe = med(f"peer pipe bytes {peer_case.split()[-1]}")
        ring_text = f"{ring.median_us:>8.1f}" if ring else f"{'-':>8}"
        ring_ratio = f"{ring.median_us / ours:>10.1f}x" if ring else f"{'-':>11}"
        print(f"{name:<40}{ours:>8.1f}{floor:>12.1f}{ring_text}{queue:>9.1f}{pipe:>9.1f}{ours / floor:>10.3f}x"
              f"{ring_ratio}{queue / ours:>11.1f}x{pipe / ours:>10.1f}x")  # fmt: skip
        table.append({"case": name, "ours_us": ours, "floor_us": floor, "ring_us": ring.median_us if ring else None,
                      "queue_us": queue, "pipe_us": pipe, "ours_over_floor": ours / floor})  # fmt: skip

    one, ring_step = "decode step, one message (shm)", "peer pickle ring decode step"

    def delivered(name: str) -> float:
        return by_name[name].delivery_median_us

    def paired_delivery(name: str, other: str) -> float:
        pairs = zip(by_name[name].delivery_us, by_name[other].delivery_us, strict=True)
        return statistics.median(a / b for a, b in pairs)

    print(f"\n{'decode step (64 pairs), latency | delivery':<46}{'ours':>9}{'ring':>9}{'ring/ours':>11}"
          f"{'ours delivery':>15}{'ring delivery':>15}{'ours / b2b':>12}")  # fmt: skip
    cadence: dict[str, float] = {}
    for label in ("", *GAP_LABELS):
        ours_name = one + (f", after {label}" if label else "")
        ring_name = ring_step + (f", after {label}" if label else "")
        ours, theirs = med(ours_name), med(ring_name)
        slower = paired_delivery(ours_name, one) if label else 1.0
        cadence[label] = slower
        when = "after " + label if label else "back to back"
        print(f"{when:<46}{ours:>9.1f}{theirs:>9.1f}{theirs / ours:>10.2f}x"
              f"{delivered(ours_name):>15.1f}{delivered(ring_name):>15.1f}{slower:>11.2f}x")  # fmt: skip
        table.append({"case": ours_name, "ours_us": ours, "ring_us": theirs, "ours_delivery_us": delivered(ours_name),
                      "ring_delivery_us": delivered(ring_name), "ours_delivery_over_back_to_back": slower})  # fmt: skip
    for label in GAP_LABELS:
        name = f"decode step, one message (shm, 1 ms spin), after {label}"
        fixed_over_learned = paired_delivery(name, f"{one}, after {label}")
        faster = "the learned spin delivers faster" if fixed_over_learned > 1 else "the fixed spin delivers faster"
        print(f"{'after ' + label + ', spin fixed at 1 ms':<46}{med(name):>9.1f}{'':>9}{'':>11}{delivered(name):>15.1f}"
              f"{'':>15}{paired_delivery(name, one):>11.2f}x; fixed / learned delivery "
              f"{fixed_over_learned:.2f}x: {faster}")  # fmt: skip
    for name in ("decode step, item by item (shm)", "decode step, six messages (shm)",
                 "decode step, one message from arrays (shm)", "peer pickle ring decode step from arrays"):  # fmt: skip
        print(f"{name:<46}{med(name):>9.1f}{'':>9}{'':>11}{delivered(name):>15.1f}{'':>15}"
              f"{med(name) / med(one):>11.2f}x of one message")  # fmt: skip

    header, floor1 = med("header v2 (shm)"), med("floor 1 words")
    fastest_peer = min(med(f"peer {p} header") for p in ("queue", "pipe", "object_list", "pickle ring"))
    copy, into = med("memoryview copy 65536 words"), med("tokens 65536 buffer into buffer (shm)")
    wakes = [(idle[0]["sent_ns"], w["received_ns"], w["cpu_fraction"]) for w in idle[1:]]
    published = idle[0]["published_ns"]
    targets = {
        "decode step: six messages (shm) / one message (shm), at least 3": paired(
            "decode step, six messages (shm)", one
        ),
        "decode step: pickle ring / one message (shm), at least 3": paired(ring_step, one),
        "decode step: item by item (shm) / one message (shm)": paired("decode step, item by item (shm)", one),
        "decode step: one message (gloo) / one raw broadcast of 137 words, at most 2.2": paired(
            "decode step, one message (gloo)", f"floor {DECODE_WORDS} words"
        ),
        "decode step from arrays: pickle ring / one message (shm)": paired(
            "peer pickle ring decode step from arrays", "decode step, one message from arrays (shm)"
        ),
        **{
            f"decode step (shm) delivery after {label} / back to back, at most 2": cadence[label]
            for label in GAP_LABELS[1:]
        },
        "decode step (shm) delivery after 0.1 ms / back to back": cadence[GAP_LABELS[0]],
        **{
            f"decode step (shm) end to end after {label} / back to back": paired(f"{one}, after {label}", one)
            for label in GAP_LABELS
        },
        "header v2 (shm) / gloo floor (1 word), at most 0.05": header / floor1,
        "fastest peer header / header v2 (shm), at least 5": fastest_peer / header,
        "head cost of ep_broadcast_cmd (shm) us, at most 3": by_name["word (shm)"].head_median_us,
        "head cost of ep_broadcast_cmd (shm) us, in a burst": by_name["8 words in a row (shm)"].head_median_us / 8,
        "head cost of ep_broadcast_cmd_for_seq (shm) us": by_name["header v2 (shm)"].head_median_us,
        "head cost of a decode step, one message (shm) us": by_name[one].head_median_us,
        "a sync point (shm), us: a sync then a header, less a header": med("sync point, then a header (shm)") - header,
        "a sync point (gloo), us: a sync then a header, less a header": med("sync point, then a header (gloo)")
        - med("header v2 (gloo)"),
        "tokens 65536 into (shm) / memoryview copy 256 KiB, at most 3": into / copy,
        "tokens 65536 buffer to buffer: pickle ring from buffer / ours (shm), at least 1.5": paired(
            "peer pickle ring tokens 65536 from buffer", "tokens 65536 buffer into buffer (shm)"
        ),
        "header: pickle ring / header v2 (shm), at least 2": paired("peer pickle ring header", "header v2 (shm)"),
        "decode step, send_batch/recv_batch from lists: pickle ring / ours (shm), at least 2": paired(
            ring_step, "decode step, send_batch/recv_batch from lists (shm)"
        ),
        "decode step, send_batch/recv_batch from arrays: pickle ring from arrays / ours (shm), at least 2.5": paired(
            "peer pickle ring decode step from arrays", "decode step, send_batch/recv_batch from arrays (shm)"
        ),
        "header v2 (shm) / shared-word ping (the Python limit), at most 8": paired(
            "header v2 (shm)", "shared-word ping (the Python limit)"
        ),
        "decode step, send_batch/recv_batch from lists (shm) / shared-word ping": paired(
            "decode step, send_batch/recv_batch from lists (shm)", "shared-word ping (the Python limit)"
        ),
        "idle worker CPU, % of a core over 3 s after 1 s idle, at most 2": 100 * max(w[2] for w in wakes),
        "wake-up after that idle, us, at most 1000": max(w[1] - w[0] for w in wakes) / 1000,
        "wake-up after that idle, from the message published, us": max(w[1] - published for w in wakes) / 1000,
    }
    print()
    for what, value in targets.items():  # a figure without a bound is printed as a figure, not as a target
        judged = verdict(what, value)
        print(f"{'target' if judged else 'figure'}: {what}: {value:.3f}{judged}")
    return targets, table


def verdict(what: str, value: float) -> str:
    """`` (met)`` or `` (missed)`` for a target that names its bound ("at least 2", "at most 8"), else nothing."""
    found = re.search(r"at (least|most) ([0-9.]+)$", what)
    if found is None:
        return ""
    bound = float(found.group(2))
    met = value >= bound if found.group(1) == "least" else value <= bound
    return " (met)" if met else " (missed)"


def plot(found: list[Result], meta: dict[str, object], path: Path) -> None:
    """Latency against payload size, log-log, one line per family and form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    lines = [
        ("floor", "words", "raw gloo broadcast (floor)", "k--"),
        ("local", "copy", "memoryview copy on the head", "k:"),
        ("peer", "tokens-list", "", "r-o"),
        ("gloo", "tokens-list", "ours over gloo, list", "b-o"),
        ("gloo", "tokens-into", "ours over gloo, buffer into buffer", "c-s"),
        ("shm", "tokens-list", "ours over shm, list", "m-o"),
        ("shm", "tokens-into", "ours over shm, buffer into buffer", "g-^"),
    ]
    for family, kind, label, style in lines:
        chosen = [r for r in found if r.family == family and r.kind == kind]
        groups: dict[str, list[tuple[int, float]]] = {}
        for r in chosen:
            groups.setdefault(r.name.rsplit(" ", 1)[0] if family == "peer" else label, []).append(
                (r.words, r.median_us)
            )
        for group, points in groups.items():
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], style if family != "peer" else "-o",
                      label=group, alpha=0.8 if family == "peer" else 1.0)  # fmt: skip
    for r in found:
        if r.kind in ("header", "decode-one", "decode-items", "decode-six") and r.gap_s == 0:
            axes.scatter([r.words], [r.median_us], marker="x", zorder=3)
            axes.annotate(r.name, (r.words, r.median_us), fontsize=5, xytext=(4, 4), textcoords="offset points")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("payload (u32 words)")
    axes.set_ylabel("median latency per call (µs)")
    axes.set_title(f"{meta['backend']}, {meta['world_size']} ranks, torch {meta['torch']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
