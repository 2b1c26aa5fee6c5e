"""Scaling-law toolkit (paper Tables 6-8, 23, 25): plan, fit, extrapolate, plot.

Fitting stands alone on any runs table (``params``, ``tokens`` or ``flops``, ``loss``,
optional metric columns).  Planning uses ``model.flops`` / ``model.config`` and is
imported lazily so the fits work without the model package's torch code.  No Ray here:
the sweep runner lives in ``model/sweep.py``.
"""

from .extrapolate import extrapolate, targets_frame
from .isoflop import IsoFLOPFit, assign_budgets, fit_isoflop
from .joint import ChinchillaFit, chinchilla_loss, default_init_grid, fit_chinchilla
from .power import PowerLawFit, fit_joint_power, fit_power_law
from .report import FamilyFits, FitOptions, ScalingReport, fit_scaling, jsonable
from .table import (RunsTableError, exclude_highest_loss, metric_columns, normalize_runs,
                    read_runs, write_table)

__all__ = [
    "ChinchillaFit", "FamilyFits", "FitOptions", "IsoFLOPFit", "PowerLawFit", "RunsTableError",
    "ScalingReport", "SweepPlan", "PlannedRun", "assign_budgets", "chinchilla_loss",
    "default_init_grid", "exclude_highest_loss", "extrapolate", "fit_chinchilla", "fit_isoflop",
    "fit_joint_power", "fit_power_law", "fit_scaling", "jsonable", "metric_columns",
    "normalize_runs", "plan_isoflop", "read_runs", "targets_frame", "write_table",
]


def __getattr__(name):  # lazy: the planner imports model.config / model.flops
    if name in ("SweepPlan", "PlannedRun", "plan_isoflop", "TINY_SHAPES"):
        from . import plan

        return getattr(plan, name)
    raise AttributeError(name)
