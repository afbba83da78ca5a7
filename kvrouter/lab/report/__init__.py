"""Reports on routing policies from ``kvrouter eval`` runs: what the notebooks under ``notebooks/`` call.

::

    scale_from_env() ─▶ Scale ─▶ comparison / seeds / sensitivity ─▶ Case, Study (specs to run)
                                                                       │ run_grid / run_studies
                                                                       ▼ (one process pool)
                                  tables: policy_table, summary_table, change_table, published_table
                                  plots:  ttft_cdf(s), bars, load_over_time, sweep

The notebooks hold no logic: every figure and table is one call here, so the test suite can execute
them at the small scale and they cannot rot.
"""

from kvrouter.lab.report import comparison, plots, published, seeds, sensitivity
from kvrouter.lab.report.grid import Case, run_grid, scale_arrival, sweep, with_param, with_rate
from kvrouter.lab.report.published import (
    AWS_8K_HIT_RATE,
    AWS_8K_SHARED_PREFIX,
    AWS_SHORT_CHAT,
    MOONCAKE_PAPER_MEAN_TTFT_S,
)
from kvrouter.lab.report.scale import ENV_VAR, SCALES, Scale, scale_from_env, sized
from kvrouter.lab.report.study import Study, StudyResult, run_studies
from kvrouter.lab.report.tables import (
    Table,
    case,
    change,
    change_table,
    closest,
    policy_table,
    published_table,
    ratio_table,
    stacked_published_table,
    summary_table,
    sweep_table,
)

__all__ = [
    "AWS_8K_HIT_RATE",
    "AWS_8K_SHARED_PREFIX",
    "AWS_SHORT_CHAT",
    "ENV_VAR",
    "MOONCAKE_PAPER_MEAN_TTFT_S",
    "SCALES",
    "Case",
    "Scale",
    "Study",
    "StudyResult",
    "Table",
    "case",
    "change",
    "change_table",
    "closest",
    "comparison",
    "plots",
    "policy_table",
    "published",
    "published_table",
    "ratio_table",
    "run_grid",
    "run_studies",
    "scale_arrival",
    "scale_from_env",
    "seeds",
    "sensitivity",
    "sized",
    "stacked_published_table",
    "summary_table",
    "sweep",
    "sweep_table",
    "with_param",
    "with_rate",
]
