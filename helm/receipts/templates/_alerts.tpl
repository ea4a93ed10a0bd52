{{/*
Alert rules of the service, as the `groups` list of a Prometheus rule file.
deploy/prometheus/receipts.rules.yaml is this list rendered with the default values
(release "receipts"); tests/chart keeps the two equal and runs promtool on both.
Nothing here may depend on a replica count: compare with what kube-state-metrics
reports about the autoscaler instead, so the plain file fits any deployment.
Queue gauges are identical on every worker (max over pods); counters are summed.

Exporters: the defaults read nothing but the workers' own /metrics. Alerts that read
kube-state-metrics render only when alerts.kubeStateMetrics says Prometheus scrapes it (or
alerts.recoveryLastSuccessFrom asks for it), and then ReceiptsKubeStateMetricsMissing fires
when its series of this release are absent, so those alerts cannot fall silent unnoticed.
The Pushgateway variant of ReceiptsRecoveryNotRunning fires on an absent push as well.

Stale gauges: a worker whose queue statistics are older than 3 refresh intervals (a
database outage) stops exporting the queue gauges and keeps exporting their timestamp.
Alerts on queue gauges therefore resolve when the gauges vanish, and
ReceiptsQueueStatsStale fires instead; the alerts that look back over a range (backlog
growth, rate-limit saturation) also require the gauge now.

An operator's pause (receipts_provider_paused{reason="manual"}) is deliberate: the lag and
backlog alerts stay silent while it holds and for alerts.manualPauseGrace after, and only
ReceiptsManualPauseLong (severity info) says when it has lasted alerts.manualPauseMaxFor.
*/}}
{{- define "receipts.alertGroups" -}}
{{- $s := include "receipts.alertSelector" . -}}
{{- $a := .Values.alerts -}}
{{- $labels := $a.additionalLabels -}}
{{- $runbook := $a.runbookUrl -}}
{{- $fullname := include "receipts.fullname" . -}}
{{- $w := $a.ratioWindow -}}
{{- $cronjob := include "receipts.recoveryName" . -}}
{{- $ksm := $a.kubeStateMetrics -}}
{{- $recoveryFrom := $a.recoveryLastSuccessFrom -}}
{{- if not $recoveryFrom -}}
{{- if .Values.config.pushgatewayUrl }}{{ $recoveryFrom = "pushgateway" }}{{ else if $ksm }}{{ $recoveryFrom = "kube-state-metrics" }}{{ end -}}
{{- end -}}
{{- $recoveryLast := "The recovery CronJob {{ $labels.cronjob }} in {{ $labels.namespace }} last succeeded {{ $value | humanizeDuration }} ago." -}}
{{- if eq $recoveryFrom "pushgateway" -}}
{{- $recoveryLast = "{{ if eq $value 1.0 }}No successful `receipts recover` is on the Pushgateway (none pushed yet, or Prometheus does not scrape the Pushgateway).{{ else }}The last successful `receipts recover` pushed to the Pushgateway finished {{ $value | humanizeDuration }} ago.{{ end }}" -}}
{{- end -}}
{{- $autoscaled := .Values.autoscaling.enabled -}}
{{- $toZero := and $autoscaled .Values.autoscaling.keda.enabled (eq (.Values.autoscaling.minReplicas | int) 0) -}}
{{- $growing := or (not $autoscaled) $ksm -}}
{{- $usesKsm := or (and $autoscaled $ksm) (and .Values.recovery.enabled (eq $recoveryFrom "kube-state-metrics")) (and $toZero $ksm) -}}
{{- /* An operator's pause, held now or within the grace period: appended to lag alerts. */ -}}
{{- $manual := printf "unless on (namespace, job)\nmax by (namespace, job) (max_over_time(receipts_provider_paused{%s,reason=\"manual\"}[%s])) == 1" $s $a.manualPauseGrace -}}
- name: receipts
  rules:
    - alert: ReceiptsQueueLagHigh
      expr: |-
        max by (namespace, job) (receipts_queue_lag_seconds{ {{- $s -}} }) > {{ $a.queueLagSeconds }}
        {{ $manual | nindent 8 | trim }}
      for: {{ $a.queueLagFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Receipts are waiting longer than {{ $a.queueLagSeconds }}s to be delivered.
        description: >-
          The oldest due ready receipt job in {{`{{ $labels.namespace }}`}} has waited
          {{`{{ $value | humanizeDuration }}`}}. Workers are not keeping up, not claiming
          (provider paused, database trouble), or not running.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsqueuelaghigh/" . }}
        {{- end }}
    - alert: ReceiptsOldestUndeliveredTooOld
      expr: |-
        max by (namespace, job) (receipts_oldest_undelivered_age_seconds{ {{- $s -}} }) > {{ $a.undeliveredAgeSeconds }}
        {{ $manual | nindent 8 | trim }}
      for: 5m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: A receipt has been undelivered for more than {{ $a.undeliveredAgeSeconds }}s since its order.
        description: >-
          The oldest ready or running receipt job in {{`{{ $labels.namespace }}`}} was
          enqueued {{`{{ $value | humanizeDuration }}`}} ago and is still not delivered.
          Retries keep the queue lag low while this grows: the provider keeps failing,
          or its answers are rate limits or timeouts.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsoldestundeliveredtooold/" . }}
        {{- end }}
    {{- if $growing }}
    - alert: ReceiptsReadyJobsGrowingAtMaxReplicas
      {{- if $autoscaled }}
      # At max replicas as the autoscaler's own status says (kube-state-metrics): the HPA
      # the chart renders, or the one KEDA makes for the ScaledObject.
      expr: |-
        delta(max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })[15m:1m]) > 0
        and on (namespace, job) max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })
        and on (namespace)
        (
          max by (namespace) (kube_horizontalpodautoscaler_status_current_replicas{horizontalpodautoscaler=~"{{ $fullname }}|keda-hpa-{{ $fullname }}"})
          >= max by (namespace) (kube_horizontalpodautoscaler_spec_max_replicas{horizontalpodautoscaler=~"{{ $fullname }}|keda-hpa-{{ $fullname }}"})
        )
        {{ $manual | nindent 8 | trim }}
      {{- else }}
      # A fixed replica count is always the maximum.
      expr: |-
        delta(max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })[15m:1m]) > 0
        and on (namespace, job) max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })
        {{ $manual | nindent 8 | trim }}
      {{- end }}
      for: 15m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Due receipt jobs keep growing while the workers run at their maximum replica count.
        description: >-
          Due ready jobs in {{`{{ $labels.namespace }}`}} have grown for 15 minutes with the
          workers at their maximum replica count. More pods will not come; raise the
          capacity (replicas within the connection budget, concurrency) or find what slows
          deliveries.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsreadyjobsgrowingatmaxreplicas/" . }}
        {{- end }}
    {{- end }}
    - alert: ReceiptsJobsFailed
      expr: >-
        sum by (namespace, job) (increase(receipts_failures_total{ {{- $s -}} }[{{ $w }}]))
        /
        (
          sum by (namespace, job) (increase(receipts_failures_total{ {{- $s -}} }[{{ $w }}]))
          + sum by (namespace, job) (increase(receipts_acks_total{ {{- $s -}} }[{{ $w }}]))
        )
        > {{ $a.failureRatio }}
        and on (namespace, job)
        sum by (namespace, job) (increase(receipts_failures_total{ {{- $s -}} }[{{ $w }}])) >= {{ $a.failureMinCount }}
      for: 5m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: More than {{ mulf $a.failureRatio 100 }}% of the receipt jobs finished in {{ $w }} failed.
        description: >-
          {{`{{ $value | humanizePercentage }}`}} of the receipt jobs that finished in
          {{`{{ $labels.namespace }}`}} in the last {{ $w }} failed (a permanent provider
          answer or their last attempt). Their customers have no receipt; review them with
          `receipts jobs list` and retry.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsjobsfailed/" . }}
        {{- end }}
    - alert: ReceiptsStaleAcks
      expr: >-
        sum by (namespace, job) (increase(receipts_stale_acks_total{ {{- $s -}} }[{{ $w }}]))
        /
        sum by (namespace, job) (increase(receipts_acks_total{ {{- $s -}} }[{{ $w }}]))
        > {{ $a.staleAckRatio }}
        and on (namespace, job)
        sum by (namespace, job) (increase(receipts_stale_acks_total{ {{- $s -}} }[{{ $w }}])) >= {{ $a.staleAckMinCount }}
      for: 5m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Workers finish deliveries after their lease has expired (more than {{ mulf $a.staleAckRatio 100 }}% of acks).
        description: >-
          Stale acks and reschedules in {{`{{ $labels.namespace }}`}} were
          {{`{{ $value | humanizePercentage }}`}} of the acks in the last {{ $w }}: the
          lease/token guard refused them. Those jobs may be delivered twice (the provider's
          idempotency key should absorb it). Leases are too short for the observed delivery
          and ack times, or workers stall.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsstaleacks/" . }}
        {{- end }}
    - alert: ReceiptsProviderPaused
      expr: >-
        max by (namespace, job, reason) (
          avg_over_time(receipts_provider_paused{ {{- $s -}} ,reason!~"manual|rejecting"}[{{ $a.providerPausedFor }}])
        ) >= 0.9
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Deliveries have been paused ({{`{{ $labels.reason }}`}}) for most of {{ $a.providerPausedFor }}.
        description: >-
          Workers in {{`{{ $labels.namespace }}`}} honoured a fleet-wide provider pause for
          {{`{{ $value | humanizePercentage }}`}} of the last {{ $a.providerPausedFor }}, reason
          {{`{{ $labels.reason }}`}} (auth: the provider refuses our credentials; outage: it
          keeps failing; retry_after: it asks us to wait). Nothing is delivered meanwhile.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsproviderpaused/" . }}
        {{- end }}
    - alert: ReceiptsProviderRejecting
      expr: >-
        max by (namespace, job) (
          avg_over_time(receipts_provider_paused{ {{- $s -}} ,reason="rejecting"}[{{ $a.providerRejectingFor }}])
        ) >= 0.9
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The provider rejects nearly every receipt; deliveries have been paused for most of {{ $a.providerRejectingFor }}.
        description: >-
          Workers in {{`{{ $labels.namespace }}`}} paused deliveries because the provider
          rejected (4xx or TLS) the receipts of many jobs while accepting none: a provider or
          contract fault, or a queue holding only invalid orders (receipts jobs list --held).
          The fleet probes with a few jobs at a time and fails no job for it; nothing is
          delivered until the provider accepts one again.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsproviderrejecting/" . }}
        {{- end }}
    - alert: ReceiptsManualPauseLong
      expr: max by (namespace, job) (receipts_provider_paused{ {{- $s -}} ,reason="manual"}) == 1
      for: {{ $a.manualPauseMaxFor }}
      labels:
        severity: info
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: An operator's pause of deliveries has held for {{ $a.manualPauseMaxFor }}.
        description: >-
          Deliveries in {{`{{ $labels.namespace }}`}} have been paused by an operator for
          {{ $a.manualPauseMaxFor }}. The lag and backlog alerts stay silent while it holds;
          receipts wait. It ends by itself at the time it was set for.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsmanualpauselong/" . }}
        {{- end }}
    - alert: ReceiptsRateLimitSaturated
      # receipts_provider_tokens is -1 without a rate limit: the bucket must have held >= 0
      # tokens (a limit is set) all the window and never a whole one.
      expr: >-
        max by (namespace, job) (max_over_time(receipts_provider_tokens{ {{- $s -}} }[{{ $a.rateLimitSaturatedFor }}])) < 1
        and on (namespace, job)
        min by (namespace, job) (min_over_time(receipts_provider_tokens{ {{- $s -}} }[{{ $a.rateLimitSaturatedFor }}])) >= 0
        and on (namespace, job)
        max by (namespace, job) (min_over_time(receipts_ready_jobs{ {{- $s -}} }[{{ $a.rateLimitSaturatedFor }}])) > 0
        and on (namespace, job)
        max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} }) > 0
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The provider's rate limit has capped deliveries for {{ $a.rateLimitSaturatedFor }} while jobs waited.
        description: >-
          The fleet's provider token bucket in {{`{{ $labels.namespace }}`}} never held a whole
          token in the last {{ $a.rateLimitSaturatedFor }}, and due jobs waited all that time:
          deliveries run at the provider's rate limit and the backlog drains no faster.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsratelimitsaturated/" . }}
        {{- end }}
    - alert: ReceiptsProviderAtCapacity
      # Adaptive concurrency (config.adaptiveConcurrency; receipts_concurrency_limit is 0
      # while it is off) holds the fleet below its ceiling (the smaller of the ceiling
      # setting and the slots: slots above the ceiling say nothing of the provider), the
      # fleet keeps its limits full (averaged over 5m: one scrape catches deliveries between
      # two answers), and the backlog grew over the window: the provider is the bottleneck.
      expr: |-
        sum by (namespace, job) (avg_over_time(receipts_inflight_deliveries{ {{- $s -}} }[5m]))
          >= 0.8 * sum by (namespace, job) (avg_over_time(receipts_concurrency_limit{ {{- $s -}} }[5m]))
        and on (namespace, job) sum by (namespace, job) (receipts_concurrency_limit{ {{- $s -}} }) > 0
        and on (namespace, job) sum by (namespace, job) (receipts_concurrency_limit{ {{- $s -}} })
          < sum by (namespace, job) (receipts_concurrency_ceiling{ {{- $s -}} })
        and on (namespace, job) delta(max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })[{{ $a.providerAtCapacityFor }}:1m]) > 0
        and on (namespace, job) max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })
      for: {{ $a.providerAtCapacityFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The provider's capacity has held deliveries for {{ $a.providerAtCapacityFor }} while the backlog grew.
        description: >-
          Adaptive concurrency in {{`{{ $labels.namespace }}`}} has held the workers below
          their ceiling, their limits full, for {{ $a.providerAtCapacityFor }}, and due jobs kept
          growing: the provider takes no more concurrent requests. More pods will not help
          (the KEDA signal stops asking for them); the backlog drains at the provider's pace.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsprovideratcapacity/" . }}
        {{- end }}
    - alert: ReceiptsDatabaseNotReady
      expr: count by (namespace, job) (receipts_database_ready{ {{- $s -}} } == 0) > 0
      for: {{ $a.databaseNotReadyFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Workers cannot use the queue's database.
        description: >-
          {{`{{ $value }}`}} worker(s) in {{`{{ $labels.namespace }}`}} have reported the
          database unavailable for {{ $a.databaseNotReadyFor }} (/readyz 503). They claim
          nothing; their delivered jobs' acks wait and, past the lease, go to recovery.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsdatabasenotready/" . }}
        {{- end }}
    - alert: ReceiptsQueueStatsStale
      expr: time() - max by (namespace, job) (receipts_queue_stats_timestamp_seconds{ {{- $s -}} }) > {{ $a.queueStatsMaxAgeSeconds }}
      for: 2m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The queue gauges have not been refreshed for over {{ $a.queueStatsMaxAgeSeconds }}s.
        description: >-
          No worker in {{`{{ $labels.namespace }}`}} has read the queue gauges for
          {{`{{ $value | humanizeDuration }}`}}. Lag, backlog, expired leases and the xmin
          horizon are unknown meanwhile (stale gauges are not exported), so their alerts
          cannot fire.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsqueuestatsstale/" . }}
        {{- end }}
    - alert: ReceiptsExpiredLeasesNotRecovered
      expr: max by (namespace, job) (receipts_expired_leases{ {{- $s -}} }) > 0
      for: {{ $a.expiredLeasesFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Expired leases are not being returned to the queue.
        description: >-
          {{`{{ $value | humanize }}`}} running jobs in {{`{{ $labels.namespace }}`}} have had
          expired leases for {{ $a.expiredLeasesFor }}. The recovery CronJob is not running
          or failing; these receipts wait until it does.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsexpiredleasesnotrecovered/" . }}
        {{- end }}
    {{- if and .Values.recovery.enabled $recoveryFrom }}
    - alert: ReceiptsRecoveryNotRunning
      {{- if eq $recoveryFrom "pushgateway" }}
      # What `receipts recover` pushes; never pushed (or the Pushgateway not scraped) counts.
      expr: >-
        time() - max by (namespace, job) (receipts_recovery_last_success_timestamp_seconds) > {{ $a.recoveryMaxAgeSeconds }}
        or absent(receipts_recovery_last_success_timestamp_seconds)
      {{- else }}
      # kube-state-metrics; a CronJob that never succeeded counts from its creation.
      expr: >-
        time() - max by (namespace, cronjob) (
          kube_cronjob_status_last_successful_time{cronjob="{{ $cronjob }}"}
          or kube_cronjob_created{cronjob="{{ $cronjob }}"}
        ) > {{ $a.recoveryMaxAgeSeconds }}
      {{- end }}
      for: 5m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The receipts recovery job has not succeeded for {{ $a.recoveryMaxAgeSeconds }}s.
        description: >-
          {{ $recoveryLast }} Expired leases are not recovered and old rows are not
          pruned.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsrecoverynotrunning/" . }}
        {{- end }}
    {{- end }}
    {{- if gt (.Values.config.retentionDays | int) 0 }}
    - alert: ReceiptsPruningBehind
      expr: >-
        max by (namespace, job) (receipts_oldest_finished_age_seconds{ {{- $s -}} })
        > {{ mul (.Values.config.retentionDays | int) 86400 }} + {{ $a.pruningBehindSeconds }}
      for: 15m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Finished receipt jobs are kept longer than the {{ .Values.config.retentionDays }}-day retention.
        description: >-
          The oldest done, failed or discarded row in {{`{{ $labels.namespace }}`}} finished
          {{`{{ $value | humanizeDuration }}`}} ago, more than the retention plus
          {{ $a.pruningBehindSeconds }}s: pruning is not running or failing, and the table
          and its indexes grow.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptspruningbehind/" . }}
        {{- end }}
    {{- end }}
    - alert: ReceiptsLongTransaction
      expr: max by (namespace, job) (receipts_oldest_transaction_age_seconds{ {{- $s -}} }) > {{ $a.longTransactionSeconds }}
      for: 2m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: A transaction in the queue's database holds back the xmin horizon.
        description: >-
          The oldest open transaction in the receipts database is
          {{`{{ $value | humanizeDuration }}`}} old. An old snapshot keeps dead index entries
          alive and makes every claim slower (≈70× in measurements).
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptslongtransaction/" . }}
        {{- end }}
    - alert: ReceiptsXminHorizonHeld
      expr: max by (namespace, job, holder) (receipts_xmin_horizon_age_transactions{ {{- $s -}} }) > {{ $a.xminHorizonTransactions | int }}
      for: {{ $a.xminHorizonFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: A {{`{{ $labels.holder }}`}} holds back the xmin horizon of the queue's database.
        description: >-
          A {{`{{ $labels.holder }}`}} (open transaction, prepared transaction or replication
          slot) keeps the xmin horizon {{`{{ $value | humanize }}`}} transaction IDs back. Dead
          rows of receipt_jobs cannot be removed while it does, so claims slow down and the
          table bloats; a prepared transaction or a replication slot has no age in seconds.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsxminhorizonheld/" . }}
        {{- end }}
    - alert: ReceiptsWorkersDown
      {{- if and $toZero $ksm }}
      # Scaled to zero is normal: alert only when the Deployment wants pods (kube-state-metrics).
      expr: >-
        (sum by (namespace, job) (up{ {{- $s -}} }) == 0 or absent(up{ {{- $s -}} }))
        and on ()
        sum(kube_deployment_spec_replicas{namespace="{{ .Release.Namespace }}",deployment="{{ $fullname }}"}) > 0
      {{- else if $toZero }}
      # Scaled to zero is normal and, without kube-state-metrics, looks like no target at
      # all: alert only when worker targets exist and none answers.
      expr: sum by (namespace, job) (up{ {{- $s -}} }) == 0
      {{- else }}
      expr: sum by (namespace, job) (up{ {{- $s -}} }) == 0 or absent(up{ {{- $s -}} })
      {{- end }}
      for: {{ $a.workersDownFor }}
      labels:
        severity: critical
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: No receipts worker is being scraped.
        description: >-
          Prometheus has scraped no receipts worker for {{ $a.workersDownFor }}. Either no
          worker runs (receipts are not delivered) or scraping is broken (no metrics, no
          alerts about the queue).
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptsworkersdown/" . }}
        {{- end }}
    {{- if $usesKsm }}
    - alert: ReceiptsKubeStateMetricsMissing
      # The alerts above that read kube-state-metrics would be silent without it.
      expr: absent(kube_deployment_spec_replicas{namespace="{{ .Release.Namespace }}",deployment="{{ $fullname }}"})
      for: 15m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Prometheus has no kube-state-metrics series for the receipts workers.
        description: >-
          kube_deployment_spec_replicas of the Deployment {{ $fullname }} in
          {{ .Release.Namespace }} has been absent for 15m. The receipts alerts that read
          kube-state-metrics (backlog at max replicas, recovery's last success, workers down
          when scaled to zero) cannot fire: install or scrape kube-state-metrics, or set
          alerts.kubeStateMetrics=false.
        {{- with $runbook }}
        runbook_url: {{ printf "%sreceiptskubestatemetricsmissing/" . }}
        {{- end }}
    {{- end }}
{{- end }}


{{/*
receipts.alertGroups without the alerts named in alerts.disabled (as kube-prometheus-stack's
disabled list does); a group left without rules is dropped. With nothing disabled the
groups are rendered as they are, so the plain rule file stays byte for byte the chart's.
*/}}
{{- define "receipts.enabledAlertGroups" -}}
{{- $off := .Values.alerts.disabled | default list -}}
{{- if $off -}}
{{- $kept := list -}}
{{- range $group := include "receipts.alertGroups" . | fromYamlArray -}}
{{- $rules := list -}}
{{- range $rule := $group.rules }}{{ if not (has $rule.alert $off) }}{{ $rules = append $rules $rule }}{{ end }}{{ end -}}
{{- if $rules }}{{ $kept = append $kept (set $group "rules" $rules) }}{{ end -}}
{{- end -}}
{{- toYaml $kept -}}
{{- else -}}
{{- include "receipts.alertGroups" . -}}
{{- end -}}
{{- end }}
