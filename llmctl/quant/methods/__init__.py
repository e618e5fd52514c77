"""The quantization methods, one per recipe modifier (see ``llmctl.quant.method``).

To add a method: a modifier in ``recipe.MODIFIERS``, a ``QuantMethod`` subclass in this
package implementing the hooks it takes part in, and one row in ``METHODS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.quant.method import QuantMethod
from llmctl.quant.methods.awq import AWQ
from llmctl.quant.methods.gptq import GPTQ
from llmctl.quant.methods.rtn import RoundToNearest
from llmctl.quant.methods.smoothquant import SmoothQuant
from llmctl.quant.recipe import (
    AWQModifier,
    GPTQModifier,
    QuantizationModifier,
    Recipe,
    SmoothQuantModifier,
)

METHODS: dict[type, type[QuantMethod]] = {
    QuantizationModifier: RoundToNearest,
    GPTQModifier: GPTQ,
    AWQModifier: AWQ,
    SmoothQuantModifier: SmoothQuant,
}


@dataclass(frozen=True)
class RecipeMethods:
    """A recipe's methods in file order, and the roles the streamer calls them in."""

    all: tuple[QuantMethod, ...]

    @property
    def weights(self) -> QuantMethod:
        """The one method that quantizes weights (``recipe`` checks there is one)."""
        return next(m for m in self.all if m.quantizes_weights)

    @property
    def smoother(self) -> QuantMethod | None:
        """The method whose scales the float pass folds in (``recipe`` allows one)."""
        return next((m for m in self.all if m.mappings(None) is not None), None)

    @property
    def fallback(self) -> QuantMethod:
        """Round-to-nearest under the weight modifier: for weights without usable
        statistics (an expert the router sent too few calibration tokens)."""
        return RoundToNearest(self.weights.modifier)  # type: ignore[attr-defined]

    @property
    def needs_data(self) -> bool:
        return any(m.needs_data for m in self.all)

    @property
    def keeps_hessians(self) -> bool:
        return any(m.keeps_hessians for m in self.all)


def methods_for(recipe: Recipe) -> RecipeMethods:
    return RecipeMethods(tuple(METHODS[type(modifier)](modifier) for _, modifier in recipe.modifiers))
