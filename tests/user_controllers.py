"""Controllers registered from outside the package, as a user would (issue 35's example): shared by the
in-process registry tests and the multi-process worker."""

from unsloth_adaptive_kl import BetaController, register_controller


def register_halve() -> type:
    """Register ``halve`` (β halves every optimizer step) and return its class."""

    @register_controller("halve")
    class Halve(BetaController):
        adapts_beta = True

        def update(self, *, global_step, kl, num_completions):
            self.beta = self.beta * 0.5
            return self.beta

    return Halve
