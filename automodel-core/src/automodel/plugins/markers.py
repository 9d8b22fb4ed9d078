"""The two pluggy markers; kept in a tiny module so ``from automodel import hookimpl`` stays light."""

import pluggy

PROJECT = "automodel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
