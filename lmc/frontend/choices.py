"""Re-exported from the protocol layer (lmc.protocol.choices), where the backends take them from."""
from ..protocol.choices import (ChoicesDecision, ChoicesSamplingMethod, GreedyTokenSelection,  # noqa: F401
                                TokenLengthNormalized, UnconditionalLikelihoodNormalized, decide,
                                greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized)
