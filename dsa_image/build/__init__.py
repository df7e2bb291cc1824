"""Build time: locks, wheels' arch checks, the bake, the image builds, the models a build makes."""
