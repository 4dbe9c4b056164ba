"""rrfp.sim: a SimPy cluster model that drives the shared rrfp policies, and the ``rrfp-sim`` CLI.

    rrfp-sim --stages 16 --jitter lognormal       # fixed 1f1b and zb-h1 vs auto on them and bfw, 10 seeds
    rrfp-sim --help ; rrfp-sim sweep --help

Python::

    from rrfp.sim import ExperimentConfig, run_experiment
    from rrfp.study.study import Study
    result = run_experiment(ExperimentConfig(study=Study(pp=8), seeds=5))

Modules: ``config`` (validated settings), ``engine`` (SimPy environment with the same-instant hook),
``model`` (the PP x TP x DP cluster), ``rendezvous`` (blocking sends, steady-state coupling only),
``megatron`` (Megatron-core's 1F1B P2P calls, the faithful baseline), ``experiment``
(hints x policies x seeds on common random numbers), ``report`` (table, JSON), ``sweep``, ``tokens``
(token-mode and scenario configs), ``token_cli`` (their options), ``cli``.
"""

from .config import ClusterConfig, ConfigError, ExperimentConfig
from .experiment import ExperimentResult, run_experiment
from .model import ClusterModel, ModelRun

__all__ = [
    "ClusterConfig",
    "ClusterModel",
    "ConfigError",
    "ExperimentConfig",
    "ExperimentResult",
    "ModelRun",
    "run_experiment",
]
