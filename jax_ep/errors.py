"""jax_ep's exception types (a leaf module: no imports, so every layer may raise them)."""


class EPError(ValueError):
    """A jax_ep call got an argument or a setup it cannot use; the message names the argument and what was expected."""


class EPTypeError(EPError, TypeError):
    """An argument has the wrong dtype or Python type."""
