"""How close is the planner to published measurements? Step-time error per source and ranking quality.

The runs are ``tests/service/data/published_runs.json`` (Narayanan et al. SC21 table 1, Korthikanti et al. 2022,
BigScience's tr11 topology benchmarks, MosaicML llm-foundry's MPT tables, and meshrun's own H100 measurements;
each source records its URL, hardware, settings and what was measured). Every run is priced with the planner's
defaults (no calibration) exactly as a user would describe it.

    python bench/bench_planner_published.py            # per-source errors and per-group ranking
    python bench/bench_planner_published.py -v         # and every run
    python bench/bench_planner_published.py --source bigscience_tr11 -v

cover: the share of runs whose measured step time lies in the prediction's interval (``service.planner.uncertainty``,
meant to hold four in five); widest: the widest interval's larger side, relative to the prediction (at most 25 %).
SC21 rows run at the micro-batches of Megatron-LM's examples/sc21/run_table_1.sh; every pre-2023 source is priced
with ``model.attention: eager`` (unfused attention), meshrun's own rows and llm-foundry's (PyTorch under
Composer, ``service.planner.profiles``) with ``cluster.kernels: eager``.

Ranking: for each group of 3+ runs of one model on one cluster that differ in layout or micro-batch, Spearman's
rho of predicted vs measured time per sample, and the regret of the planner's pick (measured time per sample of
the layout the planner ranks first / the best measured one - 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.service import published as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default=None, help="only this source")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = ap.parse_args()

    rows = P.rows(args.source)
    by: dict[str, list[P.Row]] = {}
    for r in rows:
        by.setdefault(r.run["source"], []).append(r)
    print(f"{'source':<22} {'runs':>4} {'MAPE':>6} {'max':>6} {'bias':>6} {'cover':>6} {'widest':>6}  what")
    for source, rs in by.items():
        s = P.summary(rs)
        print(
            f"{source:<22} {s['n']:>4} {s['mape']:>6.1%} {s['max']:>6.1%} {s['bias']:>+6.1%} {s['covered']:>6.0%} "
            f"{s['widest']:>6.0%}  "
            f"{P.sources()[source]['title'][:70]}"
        )
        if args.verbose:
            for r in rs:
                c = P.predict(r.run)
                st = c.step_time_s
                terms = " ".join(
                    f"{k} {getattr(st, k) / st.total:.0%}"
                    for k in ("compute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer")
                    if getattr(st, k) / st.total >= 0.01
                )
                print(
                    f"    {r.run['id']:<50} measured {r.measured_s:9.3f} s  predicted {r.predicted_s:9.3f} s "
                    f"{r.error:+6.1%} [{r.low_s:.3f}, {r.high_s:.3f}]{'' if r.covered else ' MISS'}  ({terms})"
                )
    allm = P.summary(rows)
    print(
        f"{'all':<22} {allm['n']:>4} {allm['mape']:>6.1%} {allm['max']:>6.1%} {allm['bias']:>+6.1%} "
        f"{allm['covered']:>6.0%} {allm['widest']:>6.0%}"
    )

    groups = P.ranking(rows)
    if groups:
        print(f"\n{'ranking group':<44} {'runs':>4} {'rho':>5} {'regret':>7}")
        for g in groups:
            print(f"{g.group:<44} {g.n:>4} {g.spearman:>+5.2f} {g.regret:>7.1%}")
        print(
            f"{'mean':<44} {'':>4} {statistics.fmean(g.spearman for g in groups):>+5.2f} "
            f"{statistics.fmean(g.regret for g in groups):>7.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
