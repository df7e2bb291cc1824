"""dsa_image.validation.startup on the CPU: which flags its before and after starts give vLLM
(the image's no-argument `docker run`, read from the entrypoint and the recipe)."""

from dsa_image import entrypoint
from dsa_image.recipe import load_recipe
from dsa_image.validation import startup


def test_before_is_the_image_without_the_start_up_flags_and_after_is_the_image_now():
    recipe = load_recipe()
    target = recipe.target("sm90")
    flags = startup.image_flags("sm90", None)
    added = [str(a) for a in recipe.serving["default_model_args"]]
    assert flags["before"] == ["--kv-cache-dtype", target.kv_cache_dtype]
    assert flags["after"] == [*added, "--kv-cache-dtype", target.kv_cache_dtype]
    served = entrypoint.plan_serve([], recipe, target, {}).argv
    assert all(flag in served for flag in flags["after"][::2])

