"""A request's sampling parameters, the sampler, and structured output's grammars."""
