from llmadapt.cli.main import main

main()
