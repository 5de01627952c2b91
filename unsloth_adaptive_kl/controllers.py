"""β controllers: how the KL coefficient changes from one optimizer step to the next, and their registry.

A controller is registered with :func:`register_controller`, which declares its name and its parameters
(:class:`~unsloth_adaptive_kl.declarations.Parameter`, the declaration shaping methods and estimators use)::

    @register_controller("halve")
    class Halve(BetaController):
        adapts_beta = True

        def update(self, *, global_step, kl, num_completions):
            self.beta *= 0.5  # β halves every optimizer step
            return self.beta

Everything that lists controllers or their parameters (``kl_adaptation_method``'s grammar, the
``GRPOConfig`` fields, the docs' tables, the tests) reads this registry. A controller reads its
parameters as ``self.config.<name>``.

A controller is plain Python: it holds β and whatever history it needs, is told the step's
global statistics once per optimizer step (:meth:`BetaController.update`), and round-trips its
state through :meth:`state_dict` / :meth:`load_state_dict` (JSON-serialisable, so it can live
in ``trainer_state.json``). Every process feeds it the same global statistics, so β is the
same on every rank.

β = 0 is absorbing: once a controller reaches 0 it stays there, because the trainer then stops
computing reference log-probs and a later non-zero β would have nothing to multiply.

β is always finite and >= 0, whatever the inputs: a non-finite observation (a NaN or ±inf KL or
reward) never moves it. It is skipped, counted in ``skipped_updates`` (logged as
``adaptive_kl/skipped_updates``) and warned about once per controller; a step with no valid
token is no observation at all and changes nothing. A state loaded from a checkpoint is checked.
"""

from __future__ import annotations

from __future__ import annotations

# The base, the registry and the parameters several controllers share:
from .controller_base import (  # noqa: F401  this module's names, as they have always been importable from here
    _BASE_STATE_KEYS,
    BETA_MIN,
    BETA_SCHEDULE_STEPS,
    CONTROLLERS,
    KIND,
    BetaController,
    ControllerConfig,
    ControllerMismatchError,
    ControllerSpec,
    FixedBeta,
    _finite,
    check_controller_beta,
    controller_names,
    controller_parameters,
    logger,
    make_controller,
    register_controller,
    unregister_controller,
    user_controller_names,
)

# The built-in controllers, one module each, registered here in this order (the order of the docs' tables):
from .dynamic_controller import DYNAMIC_BETA_DECAY, REWARD_THRESHOLD, REWARD_WINDOW, DynamicBeta  # noqa: F401, E402
from .ziegler_controller import KL_HORIZON, TargetKLBeta, _SaturationRun  # noqa: F401, E402
from .schedule_controller import BETA_SCHEDULE, ScheduledBeta  # noqa: F401, E402
from .reward_conditioned_controller import REWARD_BETA_MIDPOINT, REWARD_BETA_WIDTH, RewardConditionedBeta  # noqa: F401, E402
from .target_controller import HeldTargetKL  # noqa: F401, E402
