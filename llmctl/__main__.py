from llmctl.cli.app import main

main()
