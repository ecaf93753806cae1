"""Surviving a lost worker rank: the link forms again over the ranks left, and the run goes on.

A model opts in with [`LinkedEp.ep_reforms`][metrale_model_engine.LinkedEp.ep_reforms] and takes up its new
place in [`LinkedEp.ep_reformed`][metrale_model_engine.LinkedEp.ep_reformed]; on the
[`RunStopped`][metrale_model_engine.RunStopped] a lost worker causes, the head calls
[`reform_link`][metrale_model_engine.reform.reform_link], and each worker's
[`run_worker`][metrale_model_engine.run_worker] rejoins by itself.  What one re-form made of a rank's link:
[`Reform`][metrale_model_engine.reform.Reform], its lost ranks [`LostRank`][metrale_model_engine.reform.LostRank].
How a transport's ranks meet again: [`metrale_model_engine.transport.Regroup`][metrale_model_engine.transport.Regroup].
"""

from ._core.namespace import PublicDir, public_dir
from ._core.reform import DEFAULT_REFORM_TIMEOUT, LostRank, Reform
from ._trait.reform import reform_link

__all__ = ["DEFAULT_REFORM_TIMEOUT", "LostRank", "Reform", "reform_link"]
__dir__: PublicDir = public_dir(globals(), __all__)
