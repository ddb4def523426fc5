"""Engine options, as the engines import them: how an engine computes a spec, never what it computes.

The options are declared once, in core/options.py (the ground floor, so that a spec's `options`
section and the environment's overlay read the same declaration): TorchKernels and JaxKernels
(the kernel choices, with their defaults), EngineOptions (what an engine runs under: the defaults
with a spec's section on top, and $MOE_LADDER_OPTIONS on top of that where the CLI starts a run:
EngineOptions.resolve(spec.options, Options.from_env())). This module names them for the engines
and the benches; it declares nothing of its own.
"""

from __future__ import annotations

from typing import get_args

from core.options import (ENV_KEYS, CompileMode, EngineOptions, EPLayout, JaxKernelChoices, JaxKernels,  # noqa: F401
                          MGPUMode, Options, OptionsError, TorchKernelChoices, TorchKernels, choices_message)

COMPILE_MODES, EP_LAYOUTS, MGPU_MODES = get_args(CompileMode), get_args(EPLayout), get_args(MGPUMode)
