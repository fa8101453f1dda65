from draftgen.cli import main

main()
