{{/*
Alert rules of the service, as the `groups` list of a Prometheus rule file.
deploy/prometheus/receipts.rules.yaml is this list rendered with the default values
(release "receipts"); tests/chart keeps the two equal and runs promtool on both.
*/}}
{{- define "receipts.alertGroups" -}}
{{- $s := include "receipts.alertSelector" . -}}
{{- $a := .Values.alerts -}}
{{- $labels := $a.additionalLabels -}}
{{- $runbook := $a.runbookUrl -}}
- name: receipts
  rules:
    - alert: ReceiptsQueueLagHigh
      expr: max by (namespace, job) (receipts_queue_lag_seconds{ {{- $s -}} }) > {{ $a.queueLagSeconds }}
      for: {{ $a.queueLagFor }}
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Receipts are waiting longer than {{ $a.queueLagSeconds }}s to be delivered.
        description: >-
          The oldest due ready receipt job in {{`{{ $labels.namespace }}`}} has waited
          {{`{{ $value | humanizeDuration }}`}}. Workers are not keeping up, not claiming
          (provider circuit breaker, database trouble), or not running.
        runbook_url: {{ printf "%sreceiptsqueuelaghigh" $runbook }}
    - alert: ReceiptsReadyJobsGrowingAtMaxReplicas
      expr: >-
        count by (namespace, job) (up{ {{- $s -}} } == 1) >= {{ include "receipts.maxReplicas" . }}
        and on (namespace, job)
        delta(max by (namespace, job) (receipts_ready_jobs{ {{- $s -}} })[15m:1m]) > 0
      for: 15m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Due receipt jobs keep growing while all {{ include "receipts.maxReplicas" . }} worker replicas run.
        description: >-
          Due ready jobs in {{`{{ $labels.namespace }}`}} have grown for 15 minutes with the
          workers at their maximum replica count. More pods will not come; raise the
          capacity (replicas within the connection budget, concurrency) or find what slows
          deliveries.
        runbook_url: {{ printf "%sreceiptsreadyjobsgrowingatmaxreplicas" $runbook }}
    - alert: ReceiptsJobsFailed
      expr: >-
        sum by (namespace, job) (increase(receipts_failures_total{ {{- $s -}} }[15m])) > 0
        or
        max by (namespace, job) (delta(receipts_jobs{ {{- $s -}} ,state="failed"}[15m])) > 0
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Receipt jobs were moved to failed.
        description: >-
          About {{`{{ $value | humanize }}`}} receipt jobs in {{`{{ $labels.namespace }}`}}
          reached a permanent failure or their last attempt in the last 15 minutes. Their
          customers have no receipt; review them with `receipts jobs list` and retry.
        runbook_url: {{ printf "%sreceiptsjobsfailed" $runbook }}
    - alert: ReceiptsStaleAcks
      expr: sum by (namespace, job) (increase(receipts_stale_acks_total{ {{- $s -}} }[15m])) > 0
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: Workers finished deliveries after their lease had expired.
        description: >-
          {{`{{ $value | humanize }}`}} acks in {{`{{ $labels.namespace }}`}} were refused
          by the lease/token guard in the last 15 minutes. The job may have been delivered
          twice (the provider's idempotency key should absorb it). Leases are too short for
          the observed delivery and ack times, or workers stall.
        runbook_url: {{ printf "%sreceiptsstaleacks" $runbook }}
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
        runbook_url: {{ printf "%sreceiptsexpiredleasesnotrecovered" $runbook }}
    - alert: ReceiptsRecoveryNotRunning
      expr: time() - max by (namespace, job) (receipts_recovery_last_success_timestamp_seconds) > {{ $a.recoveryMaxAgeSeconds }}
      for: 5m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: The receipts recovery job has not succeeded for {{ $a.recoveryMaxAgeSeconds }}s.
        description: >-
          The last successful `receipts recover` pushed to the Pushgateway
          {{`{{ $value | humanizeDuration }}`}} ago. Expired leases are not recovered and
          old rows are not pruned.
        runbook_url: {{ printf "%sreceiptsrecoverynotrunning" $runbook }}
    - alert: ReceiptsLongTransaction
      expr: max by (namespace, job) (receipts_oldest_transaction_age_seconds{ {{- $s -}} }) > {{ $a.longTransactionSeconds }}
      for: 2m
      labels:
        severity: warning
        {{- with $labels }}{{ toYaml . | nindent 8 }}{{ end }}
      annotations:
        summary: A transaction in the queue's database has been open for too long.
        description: >-
          The oldest open transaction in the receipts database is
          {{`{{ $value | humanizeDuration }}`}} old. An old snapshot keeps dead index entries
          alive and makes every claim slower (≈70× in measurements).
        runbook_url: {{ printf "%sreceiptslongtransaction" $runbook }}
    - alert: ReceiptsWorkersDown
      {{- if and .Values.autoscaling.enabled .Values.autoscaling.keda.enabled (eq (.Values.autoscaling.minReplicas | int) 0) }}
      # Scaled to zero is normal: alert only when the Deployment wants pods (kube-state-metrics).
      expr: >-
        (sum by (namespace, job) (up{ {{- $s -}} }) == 0 or absent(up{ {{- $s -}} }))
        and on ()
        sum(kube_deployment_spec_replicas{namespace="{{ .Release.Namespace }}",deployment="{{ include "receipts.fullname" . }}"}) > 0
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
        runbook_url: {{ printf "%sreceiptsworkersdown" $runbook }}
{{- end }}
