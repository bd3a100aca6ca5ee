"""The run recipes (configs/tiny.py, smollm2.py, ...): each module's get_config(arg) returns the
run config. A launcher loads one by path (`--config=configs/tiny.py:arg`, ml_collections'
config_flags; magistral_jax/run/recipes.py for code that is handed a path); tests import them by
name (`from configs import tiny`), with the repository root on sys.path (pytest.ini pythonpath).
Not installed with the package (setup.py): a recipe is a file a user edits and points at."""
