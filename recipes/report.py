"""Render the MMDU paper's Tables 2, 3 and 5 with our results beside them (same as `mmtune report`).

    python recipes/report.py --results outputs --sweep launch/sweeps/table5_eval.yaml --out reports/table5
    python recipes/report.py --results outputs --tables tiny_table5 --out reports/tiny

Writes report.md, report.html, report.json and one PNG per table; cells without a result
show "—". The work happens in mmtune.evaluation.reporting.tables.
"""

import sys

from mmtune.evaluation.reporting.tables import main

if __name__ == "__main__":
    sys.exit(main())
