"""What a run's results say, for people and gates: tables, golden plans, drift, Markdown.

    table           the one fixed-width text-table formatter (bench, perf, summary)
    summary         totals, the final table, the JSON document, the exit status
    plans           golden fusion plans per Transformers line: entries, files, diffs in words
    drift           a run against the nearest line's golden plan
    reach           per fuser family: module classes reached, main refusals of the rest
    report_md       a results file as Markdown for reviewers
    speed_report    bench / perf JSON as a Markdown table; speed_plot the same as a PNG

May import: harness.oracles (their constants), harness.base. Runs nothing.
"""
