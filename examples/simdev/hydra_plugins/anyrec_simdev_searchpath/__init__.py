"""Adds the package's config groups (`backend=simdev`) to the search path of anyrec's Hydra apps."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class SimdevSearchPathPlugin(SearchPathPlugin):
    """Hydra finds this class in the `hydra_plugins` namespace package and calls it at startup."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="anyrec-simdev", path="pkg://anyrec_simdev.conf")
