"""The recipe model (recipes/glm5-dsa.toml) and the helpers every other package shares."""
