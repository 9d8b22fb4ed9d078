"""The core's own commands, one module each, registered through ``automodel_register_commands`` like a plugin's."""

from automodel.cli.commands import cp, new, plot, plugins, recipes, run, targets, validate

CORE_COMMANDS = (run.run, validate.validate, recipes.recipes, plugins.plugins, targets.targets, cp.cp, new.new,
                 plot.plot)
