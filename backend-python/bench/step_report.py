"""Printing a device's report: the profiled device's step table (step_profile.py's `StepProfiler`)
or the simulated device's busy and idle time (simulated_device.py). Plain data in, text out, so an
HTTP client can print the server's reports without importing torch."""

from __future__ import annotations


def print_report(report: dict[str, object], label: str = "") -> None:
    """The table of one device's `StepProfiler.report()`."""
    if not report:
        return
    print(f"\nstep profile{label}: {report['steps']} steps, {report['total_s']:.2f} s from the first step's start to the last's end; "
          f"GPU idle between steps {report['idle_between_steps_s']:.2f} s")  # fmt: skip
    print(f"{'kind':>14}{'steps':>7}{'GPU s':>8}{'ms/step':>9}{'gap ms':>8}{'host ms':>9}{'forward':>9}{'sample':>8}"
          f"{'before':>8}{'retries':>9}{'frees':>7}{'syncs':>7}{'b.waits':>9}{'decode rows':>13}{'prefill tok':>13}{'chunk':>7}")  # fmt: skip
    for key, row in report["groups"].items():  # type: ignore[attr-defined]
        # forward, sample: the host ms spent inside the model's eager forward and the sampler call;
        # before: host ms from the previous issue's return to this one's start; retries, frees,
        # syncs: the allocator's during the issue, summed over the group's steps (frees and syncs wait
        # for the device); b.waits: all three from the previous issue's return to this one's start
        print(f"{key:>14}{row['steps']:>7}{row['gpu_s']:>8.2f}{row['ms_per_step']:>9.1f}{row['gap_ms']:>8.2f}{row['host_ms']:>9.1f}"
              f"{row.get('forward_host_ms', 0.0):>9.1f}{row.get('sample_host_ms', 0.0):>8.1f}"
              f"{row.get('between_host_ms', 0.0):>8.1f}{row.get('alloc_retries', 0):>9}{row.get('device_frees', 0):>7}{row.get('allocator_syncs', 0):>7}{row.get('allocator_between', 0):>9}"
              f"{row['decode_rows']:>13.0f}{row['prefill_tokens']:>13.0f}{row['longest_chunk']:>7.0f}")  # fmt: skip
    fit = report.get("mixed_fit")
    if isinstance(fit, dict) and fit.get("no_fit"):
        print(f"mixed steps: no fit of a cost per prompt token and per decode row (their prompt tokens spread "
              f"{100 * fit['prefill_tokens_spread']:.1f}%, their decode rows {100 * fit['decode_rows_spread']:.1f}%; "
              f"a fit needs {100 * fit['min_spread']:.0f}% each and no negative cost)")  # fmt: skip
    elif isinstance(fit, dict):
        print(f"mixed steps: ms = {fit['ms']:.2f} + {fit['us_per_prefill_token']:.2f} us * prefill_tokens + {fit['us_per_decode_row']:.2f} us * decode_rows")


def print_device_report(report: dict[str, object], label: str = "") -> None:
    """Either kind of report: the profiled device's table, the simulated device's one line."""
    if "groups" in report:
        print_report(report, label)
    elif report:
        print(f"\nsimulated device{label}: busy {report['busy_s']:.2f} s, idle between steps {report['idle_s']:.2f} s")
