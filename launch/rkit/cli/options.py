"""Options several commands share, and the checks at the command line's edge (the cli/ modules stay thin)."""

from __future__ import annotations

import math

import click

overrides_option = click.option("-o", "--override", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                                help="Set a recipe value before validation (repeatable).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange without NaN and the infinities, which every comparison lets through."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


def limits_options(fn, threshold: float = 0.05):
    """How far two outcomes may be apart and still agree (rkit compare, rkit reproduce, rkit bench)."""
    fn = click.option("--threshold", type=FiniteFloatRange(0, 10), default=threshold, show_default=True,
                      help="A metric may be worse by this fraction (0.05 = 5 %) before it counts; it counts only "
                           "when its whole confidence interval is beyond it.")(fn)
    return click.option("--loss-tolerance", type=FiniteFloatRange(0), default=0.0, show_default=True,
                        help="Largest |loss A - loss B| per step that still agrees; 0 = bit-exact.")(fn)
