"""slow_network's links: the stage namespaces of each link (``_netns.Lab``), shaped with tbf or carried by the delay
relay (``_delay_link.py``), and each link checked against its configuration before its runs (round trip of a UDP
echo, throughput of a TCP transfer; with sites, also two stages within one site), with the table of those checks.

Endpoint (and global rank) ``i`` runs stage ``S - 1 - i``: rank 0 holds the last stage.
"""

from __future__ import annotations

import argparse
import textwrap

from _netns import Endpoint, Lab, NetnsError
from _slow_network_report import _fmt
from _slow_network_settings import LinkSpec, Mode, _ms

# what TCP can carry at most: 1448 payload bytes (MSS with timestamps) per 1500-byte IP packet; tbf also counts the
# 14-byte Ethernet header of each frame on a veth, the relay counts IP bytes
PAYLOAD_SHARE = {"veth+tbf": 1448 / 1514, "tun+relay": 1448 / 1500}
RTT_SLACK_MS = 15.0  # a check passes with the RTT median in [2 x delay, 2 x delay + this] and the throughputs in:
THROUGHPUT_BOUNDS = (0.6, 1.1)  # x the configured rate
MEASURED = ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max", "rtt_samples", "ping_lost", "owd_ms_there", "owd_ms_back",
            "owd_ms_there_min", "owd_ms_back_min", "tcp_connect_ms", "congestion_control", "bytes", "seconds",
            "mbit_s", "steady_mbit_s")  # what _delay_link.measure returns


def endpoint_sites(sites: tuple[int, ...] | None) -> list[int] | None:
    """The sites in the order of the stage endpoints: endpoint (and global rank) ``i`` runs stage ``S - 1 - i``
    (rank 0 holds the last stage), so the per-stage list is reversed."""
    return None if sites is None else list(reversed(sites))


def probe_pairs(sites: tuple[int, ...] | None, n: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """Endpoint indices to measure a link between: (a pair that crosses the slow link, a pair within one site or
    None). Without sites: endpoints 0 and 1, no same-site pair. With sites: neighbouring stages, so the cross-site
    pair is a real pipeline boundary."""
    if sites is None:
        return (0, 1), None
    order = endpoint_sites(sites)
    cross = next((i, i + 1) for i in range(n - 1) if order[i] != order[i + 1])
    same = next(((i, i + 1) for i in range(n - 1) if order[i] == order[i + 1]), None)
    return cross, same


def shaping_text(link: LinkSpec, args: argparse.Namespace) -> str:
    """How ``link`` is made, in words (printed, and saved under ``shaping`` in the settings)."""
    if link.delay_ms is None:
        return f"veth, tbf burst {args.burst} latency {args.latency}"
    text = f"TUN + relay, per-sender rate without burst, queue {_ms(args.latency):g} ms, delay {link.delay_ms:g} ms"
    if link.sites is not None:
        text += f"; between sites only (sites {','.join(map(str, link.sites))}; within a site: no limit, no delay)"
    return text


def build_links(lab: Lab, mode: Mode) -> tuple[list[Endpoint], list[Endpoint]]:
    """The veth star if a link needs it, the delay star (TUN devices) if a link has a delay."""
    stage_eps = lab.build_star(mode.stages) if any(x.delay_ms is None for x in mode.links) else []
    delay_eps = (lab.build_delay_star(max(2, mode.stages)) if any(x.delay_ms is not None for x in mode.links)
                 else [])
    return stage_eps, delay_eps


def configure_link(lab: Lab, link: LinkSpec, args: argparse.Namespace, stage_eps: list[Endpoint],
                   delay_eps: list[Endpoint]) -> list[Endpoint]:
    """Make every stage link ``link`` (reshape the veths, or restart the relay); returns the endpoints to use."""
    if link.delay_ms is None:
        lab.shape(link.rate_mbit, args.burst, args.latency)
        return stage_eps
    lab.set_delay_links(link.rate_mbit, link.delay_ms, _ms(args.latency), sites=endpoint_sites(link.sites))
    return delay_eps


def relay_summary(stats: dict | None) -> dict | None:
    """The relay's counters over all stage links: what it carried, dropped, and how late it delivered."""
    if not stats:
        return None
    ports = stats["ports"]

    def worst(key):
        values = [p[key] for p in ports if p[key] is not None]
        return max(values) if values else None

    return {"uptime_s": stats["uptime_s"], "cpu_s": stats["cpu_s"],
            "packets": sum(p["rx_packets"] for p in ports), "frames": sum(p["frames"] for p in ports),
            "wire_bytes": sum(p["wire_bytes"] for p in ports), "queue_drops": sum(p["queue_drops"] for p in ports),
            "lan_packets": sum(p["lan_packets"] for p in ports), "lan_bytes": sum(p["lan_bytes"] for p in ports),
            "unroutable": sum(p["unroutable"] for p in ports), "write_errors": sum(p["write_errors"] for p in ports),
            "late_ms_p50_worst_link": worst("late_ms_p50"), "late_ms_p99_worst_link": worst("late_ms_p99"),
            "late_ms_max": worst("late_ms_max"), "max_queue_ms": max(p["max_queue_us"] for p in ports) / 1000}


def _measure_pair(lab: Lab, src: Endpoint, dst: Endpoint) -> dict:
    """``Lab.measure`` (20 pings, 2 s of TCP); a failure is recorded under ``error``, every number then None."""
    try:
        return lab.measure(src, dst, pings=20, seconds=2.0)
    except NetnsError as err:  # recorded and printed; the runs on this link still go ahead
        return dict(dict.fromkeys(MEASURED, None), error=str(err))


def check_link(lab: Lab, link: LinkSpec, endpoints: list[Endpoint], args: argparse.Namespace) -> dict:
    """What the configured link really does between two stage namespaces (the first two; with sites, two
    neighbouring stages in different sites): round-trip time of a UDP echo (expect 2 x delay) and the throughput of a
    2-second TCP transfer (expect the rate, less the header share). With sites, a pair of neighbouring stages in one
    site is measured too (``same_site``: expect no delay and no rate limit)."""
    (a, b), same = probe_pairs(link.sites, len(endpoints))
    m = _measure_pair(lab, endpoints[a], endpoints[b])
    expect = 2 * (link.delay_ms or 0.0)
    last = len(endpoints) - 1  # endpoint i runs stage last - i
    rec = {"link": link.label, "rate_mbit": link.rate_mbit, "delay_ms": link.delay_ms, "link_kind": link.kind,
           "sites": None if link.sites is None else list(link.sites),
           "shaping": shaping_text(link, args), "from": endpoints[a].addr, "to": endpoints[b].addr,
           "from_stage": last - a, "to_stage": last - b,
           "expected_rtt_ms": expect, "payload_ceiling_mbit_s": link.rate_mbit * PAYLOAD_SHARE[link.kind], **m}
    rec["throughput_ratio"] = m["steady_mbit_s"] / link.rate_mbit if m["steady_mbit_s"] else None
    rec["throughput_ratio_whole"] = m["mbit_s"] / link.rate_mbit if m["mbit_s"] else None
    problems = [f"measurement failed: {m['error']}"] if m.get("error") else []
    if m["rtt_ms_median"] is None or not expect <= m["rtt_ms_median"] <= expect + RTT_SLACK_MS:
        problems.append(f"RTT median {_fmt(m['rtt_ms_median'], '.2f')} ms not in [{expect:g}, "
                        f"{expect + RTT_SLACK_MS:g}]")
    if m["rtt_ms_min"] is not None and m["rtt_ms_min"] < expect:
        problems.append(f"a round trip ({m['rtt_ms_min']:.2f} ms) was shorter than 2 x delay")
    for way in ("there", "back"):
        low = m[f"owd_ms_{way}_min"]
        if low is not None and low < (link.delay_ms or 0.0):
            problems.append(f"a packet arrived {way} after {low:.2f} ms, before the one-way delay")
    lo, hi = THROUGHPUT_BOUNDS
    for key in ("throughput_ratio", "throughput_ratio_whole"):
        if rec[key] is None or not lo <= rec[key] <= hi:
            problems.append(f"{key} {_fmt(rec[key], '.2f')} not in [{lo}, {hi}]")
    rec["same_site"] = None
    if same is not None:
        rec["same_site"] = dict(_measure_pair(lab, endpoints[same[0]], endpoints[same[1]]), from_stage=last - same[0],
                                to_stage=last - same[1], **{"from": endpoints[same[0]].addr,
                                                            "to": endpoints[same[1]].addr})
        problems += same_site_problems(rec["same_site"])
    rec["problems"] = problems
    rec["verdict"] = "ok" if not problems else "FAILED" if m.get("error") else "OFF"
    rec["relay"] = relay_summary(lab.relay_stats()) if link.delay_ms is not None else None
    return rec


def same_site_problems(m: dict) -> list[str]:
    """Within a site packets pass at once: a round trip there must stay under the slack allowed for scheduling."""
    if m.get("error"):
        return [f"same-site measurement failed: {m['error']}"]
    if m["rtt_ms_median"] is None or m["rtt_ms_median"] > RTT_SLACK_MS:
        return [f"same-site RTT median {_fmt(m['rtt_ms_median'], '.2f')} ms, not under {RTT_SLACK_MS:g} ms: the "
                "site's LAN is not fast"]
    return []


def check_summary(link: LinkSpec, check: dict) -> str:
    """One line on a link's check, printed before its runs."""
    c = check
    return (f"link {link.label}: RTT {_fmt(c['rtt_ms_median'], '.2f')} ms (expect {c['expected_rtt_ms']:g}),"
            f" TCP {_fmt(c['steady_mbit_s'], '.1f')} Mbit/s bulk, {_fmt(c['mbit_s'], '.1f')} whole: "
            f"{c['verdict']}" + (f" ({'; '.join(c['problems'])})" if c["problems"] else ""))


LINK_LEGEND = (
    "RTT: UDP echo of 64 bytes between stage namespaces 0 and 1, 20 samples one at a time (min/median/max); expect: "
    "2 x one-way delay; one-way: median delay there (0 -> 1) / back, ms, from the clock all namespaces share; TCP: "
    "payload received per second in a 2-second transfer (bulk: median of 100 ms intervals in its "
    "second half, whole: from accept to the last byte, TCP start-up included); /rate: bulk / configured rate (TCP "
    f"payload is at most 1448/1500 of it, 1448/1514 on tbf, which counts Ethernet headers); ok: RTT median in [expect, "
    f"expect + {RTT_SLACK_MS:g} ms], no round trip under expect and no packet faster than the delay, both rates in "
    f"{list(THROUGHPUT_BOUNDS)} x rate; drops, "
    "late: the relay's queue drops and how late it delivered (p99 of the worst link, ms) during the check."
)


def print_link_checks(checks: list[dict]) -> None:
    head = (f"{'link':<16} {'kind':<9} {'RTT ms min/med/max':>22} {'expect':>6} {'one-way':>11} {'TCP bulk':>8} "
            f"{'whole':>6} {'/rate':>5} {'ok':>6} {'drops':>5} {'late':>5}")
    print(head)
    print("-" * len(head))
    for c in checks:
        relay = c.get("relay") or {}
        rtt = "/".join(_fmt(c[k], ".2f") for k in ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max"))
        one_way = f"{_fmt(c['owd_ms_there'], '.1f')}/{_fmt(c['owd_ms_back'], '.1f')}"
        print(f"{c['link']:<16} {c['link_kind']:<9} {rtt:>22} {c['expected_rtt_ms']:>6.0f} {one_way:>11} "
              f"{_fmt(c['steady_mbit_s'], '.1f'):>8} {_fmt(c['mbit_s'], '.1f'):>6} "
              f"{_fmt(c['throughput_ratio'], '.2f'):>5} {c['verdict']:>6} "
              f"{_fmt(relay.get('queue_drops'), 'd'):>5} {_fmt(relay.get('late_ms_p99_worst_link'), '.2f'):>5}")
    for c in checks:
        if c.get("sites") is not None:
            print(f"  {c['link']}: measured across sites, stages {c['from_stage']} -> {c['to_stage']}"
                  + _same_site_text(c.get("same_site")))
        for problem in c["problems"]:
            print(f"  WARNING {c['link']}: {problem}")
    print(textwrap.fill(LINK_LEGEND, width=118))


def _same_site_text(m: dict | None) -> str:
    if m is None:
        return "; no two neighbouring stages share a site"
    rtt = "/".join(_fmt(m[k], ".2f") for k in ("rtt_ms_min", "rtt_ms_median", "rtt_ms_max"))
    return (f"; within a site, stages {m['from_stage']} -> {m['to_stage']}: RTT {rtt} ms, TCP bulk "
            f"{_fmt(m['steady_mbit_s'], '.1f')} Mbit/s, whole {_fmt(m['mbit_s'], '.1f')}")
