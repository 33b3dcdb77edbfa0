"""Names vulture reports as unused that are used: read by `make lint`'s dead-code check.

    vulture mok_core mok_comm mok_torch mok_jax_adapter tools/vulture_allow.py --min-confidence 80

Add a name here only with the reason it is a false positive.
"""
# numba's @intrinsic calls every typing function as f(typingctx, *args): the first parameter
# is part of the signature even where the function does not look at it.
typingctx  # noqa: B018,F821
