"""The serving tests: a package (the one test folder that is), so that the apps its conftest starts
are package-scoped: started once for every test here and stopped when the last one ends."""
