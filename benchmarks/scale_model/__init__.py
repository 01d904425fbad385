"""A discrete-event model of the pipeline, calibrated here, extrapolated to data-centre sizes.

Run with ``sao bench scale`` (``--quick`` for a smoke run; ``--validate`` also runs the real pipeline
at small configurations on this machine and compares). It writes ``docs/results/scale.json`` and the
``scale`` section of ``docs/RESULTS.md``; ``docs/SCALING.md`` discusses the predictions.

Modules, each one part (what is simulated, and how, is in :mod:`.simulator`'s docstring):

* :mod:`.scenario`: :class:`Scenario`, what the model is given, and :class:`Prediction`, what it says.
* :mod:`.simulator`: the discrete-event simulation, :func:`simulate`.
* :mod:`.measurement`: what a real run did, read from its lake.
* :mod:`.calibration`: this machine as a scenario, its full-speed costs fitted to one measured run.
* :mod:`.validation_runs`: the real pipeline run here at small configurations (``--validate``).
* :mod:`.validation`: calibrated on the first run, the model predicts the others.
* :mod:`.hardware`: assumed data-centre hardware and a rollout replica's decode curve on it.
* :mod:`.datacentre`: data-centre scenarios and the grid ``docs/SCALING.md`` tabulates.
* :mod:`.report`: the markdown of ``docs/RESULTS.md``'s and ``docs/SCALING.md``'s sections.
* :mod:`.cli`: ``sao bench scale``'s :func:`main`.
* :mod:`.paths`: the repository root and the results directory.
"""

from benchmarks.scale_model.cli import main
from benchmarks.scale_model.datacentre import datacentre_scenario
from benchmarks.scale_model.hardware import Hardware, decode_curve, replica_gpus
from benchmarks.scale_model.scenario import Prediction, Scenario
from benchmarks.scale_model.simulator import simulate

__all__ = ["Hardware", "Prediction", "Scenario", "datacentre_scenario", "decode_curve", "main", "replica_gpus",
           "simulate"]
