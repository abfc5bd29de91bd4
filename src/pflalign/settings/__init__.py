"""The run configuration's values: plain dataclasses with the paper's defaults, presets, and
``--set key=value`` overrides with dotted keys (``lora.r=8``, ``data.name=flan``,
``method_args.beta=0.95``), each value checked on its own (types, ranges, finite numbers).

A config file is TOML or JSON with the same nesting; ``--config`` also takes a
preset name. The resolved config is written to the run directory as JSON.

This package only hands names on (``pflalign.settings.RunConfig``, ``settings.METHOD_NAMES``, ...),
from its rooms: the dataclasses, names and presets (`run_config`), the defaults that fill a key
left unset (`defaults`), the value checks (`checks`) and the overrides from presets, files and
``--set`` (`overrides`).

The bottom of the import layers (issue 40): this package imports only `pflalign.errors`.
Checking a config against the methods, the data options and the optional extras, and building
the run's method, is `pflalign.config`'s job, one layer up.
"""

from .checks import SEED_LIMIT, check, check_method_name, check_optimizer_values, check_values  # noqa: F401
from .defaults import (ADAMW_LR, DEFAULTS, PFLALIGN_BETA, PFLALIGN_LR, PFLALIGN_METHODS, SGD_LR,  # noqa: F401
                       default_lr, preconditioned, resolve_defaults)
from .overrides import flat, load_config_source, merge, parse_set, parse_value  # noqa: F401
from .run_config import (METHOD_NAMES, OPTIMIZERS, PRESETS, SCHEDULES, DataColumns, DataConfig,  # noqa: F401
                         EvalConfig, LogConfig, LoraSettings, OptimizerConfig, RunConfig, to_dict)
