#!/usr/bin/env python3
"""Where a profiled step leaves the GPU idle, and what the CPU was doing then.

Reads the Chrome trace `train --profile_step=N --trace_file=F` writes on a CUDA
job (operators on "thread" rows, kernels on "gpu stream" rows) and prints the
GPU's busy and idle time over the step, then each idle gap of at least
--min_us microseconds in time order (up to --rows of them), with the kernels on
either side and the innermost CPU operator or scope running when the GPU went
idle and when it resumed, and the idle time summed by that CPU operator.

  python3 tools/gpu/trace_gaps.py build/trace_micro32.json [--min_us=20] [--rows=40]
"""
import argparse
import collections
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--min_us", type=float, default=20)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    row_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu_rows = {row for row, name in row_names.items() if "gpu stream" in name}
    spans = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e for e in spans if (e["pid"], e["tid"]) in gpu_rows), key=lambda e: e["ts"])
    cpu = [e for e in spans if (e["pid"], e["tid"]) not in gpu_rows and "operator" == e.get("cat")]
    if not kernels:
        raise SystemExit("no GPU kernels in %s (was it a CUDA job's --profile_step trace?)" % args.trace)

    def cpu_at(t):  # the shortest CPU span covering time t
        covering = [e for e in cpu if e["ts"] <= t <= e["ts"] + e["dur"]]
        return min(covering, key=lambda e: e["dur"])["name"] if covering else "(no operator)"

    gaps, end, previous = [], kernels[0]["ts"], kernels[0]
    for k in kernels:
        if k["ts"] - end >= args.min_us:
            gaps.append((end, k["ts"], previous["name"], k["name"]))
        if k["ts"] + k["dur"] > end:
            end, previous = k["ts"] + k["dur"], k
    first, last = kernels[0]["ts"], end
    idle = sum(b - a for a, b, _, _ in gaps)
    print("kernels from first to last: %.2f ms; idle gaps of >= %g us: %d, %.2f ms (%.1f%%)" %
          ((last - first) / 1e3, args.min_us, len(gaps), idle / 1e3, 100 * idle / (last - first)))
    by_cpu = collections.Counter()
    for i, (a, b, before, after) in enumerate(gaps):
        went, resumed = cpu_at(a + 1), cpu_at(b - 1)
        by_cpu[went] += b - a
        if i < args.rows:
            print("%9.3f ms +%7.1f us | after %-40.40s | before %-40.40s | cpu: %s -> %s" %
                  ((a - first) / 1e3, b - a, before, after, went, resumed))
    print("idle by the CPU operator running when the GPU went idle:")
    for name, us in by_cpu.most_common(15):
        print("  %8.1f us  %s" % (us, name))


if __name__ == "__main__":
    main()
