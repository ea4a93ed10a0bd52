{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "receipts.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart>", or the release name when it already contains the chart
name. Resource names derive from it (CronJob names are limited to 52 characters).
*/}}
{{- define "receipts.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "receipts.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: frozen (a Deployment's selector cannot change after install).
*/}}
{{- define "receipts.selectorLabels" -}}
app.kubernetes.io/name: {{ include "receipts.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels for every object; pass a dict with "ctx" (the root context) and "component".
*/}}
{{- define "receipts.labels" -}}
helm.sh/chart: {{ include "receipts.chart" .ctx }}
{{ include "receipts.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: receipts
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of the worker pods.
*/}}
{{- define "receipts.workerSelectorLabels" -}}
{{ include "receipts.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "receipts.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "receipts.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "receipts.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding RECEIPTS_DATABASE_URL and RECEIPTS_PROVIDER_TOKEN.
*/}}
{{- define "receipts.secretName" -}}
{{- default (include "receipts.fullname" .) .Values.secret.existingSecret }}
{{- end }}

{{/*
Secret environment variables (from the Secret, never from the ConfigMap).
Pass a dict with "ctx" (root) and "secretName".
*/}}
{{- define "receipts.secretEnv" -}}
- name: RECEIPTS_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.databaseUrlKey }}
- name: RECEIPTS_PROVIDER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.providerTokenKey }}
      optional: true
{{- end }}

{{/*
Non-secret settings as a map NAME: "value" (the ConfigMap data, and the migration hook's
inline env, which runs before the ConfigMap exists).
*/}}
{{- define "receipts.configData" -}}
{{- $c := .Values.config -}}
RECEIPTS_PROVIDER_URL: {{ $c.providerUrl | quote }}
RECEIPTS_CONCURRENCY: {{ $c.concurrency | int | quote }}
RECEIPTS_LEASE_SECONDS: {{ $c.leaseSeconds | int | quote }}
RECEIPTS_LEASE_MARGIN_SECONDS: {{ $c.leaseMarginSeconds | int | quote }}
RECEIPTS_MAX_ATTEMPTS: {{ $c.maxAttempts | int | quote }}
RECEIPTS_DELIVERY_TIMEOUT_SECONDS: {{ $c.deliveryTimeoutSeconds | toString | quote }}
RECEIPTS_POLL_INTERVAL_SECONDS: {{ $c.pollIntervalSeconds | toString | quote }}
RECEIPTS_CLAIM_BATCH_MAX: {{ $c.claimBatchMax | int | quote }}
RECEIPTS_METRICS_PORT: {{ .Values.metrics.port | int | quote }}
RECEIPTS_LOG_LEVEL: {{ $c.logLevel | quote }}
RECEIPTS_POOL_MAX_SIZE: {{ $c.poolMaxSize | int | quote }}
RECEIPTS_LISTEN_NOTIFY: {{ and $c.listenNotify (not $c.pgbouncer) | toString | quote }}
RECEIPTS_PGBOUNCER: {{ $c.pgbouncer | toString | quote }}
RECEIPTS_SHUTDOWN_GRACE_SECONDS: {{ $c.shutdownGraceSeconds | toString | quote }}
RECEIPTS_RETRY_BASE_SECONDS: {{ $c.retryBaseSeconds | toString | quote }}
RECEIPTS_RETRY_CAP_SECONDS: {{ $c.retryCapSeconds | toString | quote }}
RECEIPTS_RETENTION_DAYS: {{ $c.retentionDays | int | quote }}
RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS: {{ $c.queueStatsIntervalSeconds | toString | quote }}
RECEIPTS_STATEMENT_TIMEOUT_SECONDS: {{ $c.statementTimeoutSeconds | toString | quote }}
RECEIPTS_LOCK_TIMEOUT_SECONDS: {{ $c.lockTimeoutSeconds | toString | quote }}
{{- with $c.pushgatewayUrl }}
RECEIPTS_PUSHGATEWAY_URL: {{ . | quote }}
{{- end }}
{{- range $k, $v := $c.extraEnv }}
{{ $k }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/*
Most worker pods that can run at once (the Deployment never surges: maxSurge is 0).
*/}}
{{- define "receipts.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.maxReplicas | int }}{{ else }}{{ .Values.worker.replicaCount | int }}{{ end }}
{{- end }}

{{/*
Connection budget arithmetic (docs/design.md §7), as a dict of ints (JSON).
*/}}
{{- define "receipts.connections" -}}
{{- $c := .Values.config -}}
{{- $listener := ternary 1 0 (and $c.listenNotify (not $c.pgbouncer)) -}}
{{- $perPod := add ($c.poolMaxSize | int) $listener -}}
{{- $replicas := include "receipts.maxReplicas" . | int -}}
{{- $recovery := ternary 1 0 .Values.recovery.enabled -}}
{{- $migration := ternary 1 0 .Values.migration.enabled -}}
{{- $reserved := .Values.connectionBudget.reserved | int -}}
{{- $ui := ternary (mul 2 (.Values.ui.replicas | int)) 0 .Values.ui.enabled -}}
{{- $total := add (mul $replicas $perPod) $recovery $migration $reserved $ui -}}
{{- dict "replicas" $replicas "pool" ($c.poolMaxSize | int) "listener" $listener "perPod" $perPod "recovery" $recovery "migration" $migration "reserved" $reserved "ui" $ui "total" $total "budget" (.Values.connectionBudget.maxConnections | int) | toJson }}
{{- end }}

{{/*
One line of connection arithmetic for messages and NOTES.txt.
*/}}
{{- define "receipts.connectionsLine" -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- $ui := ternary (printf " + review page %d" (int $n.ui)) "" (gt (int $n.ui) 0) -}}
{{- printf "%d max replicas × %d per pod (pool %d + listener %d) + recovery %d + migration %d + reserved %d%s = %d connections; budget %d" (int $n.replicas) (int $n.perPod) (int $n.pool) (int $n.listener) (int $n.recovery) (int $n.migration) (int $n.reserved) $ui (int $n.total) (int $n.budget) }}
{{- end }}

{{/*
Seconds Kubernetes waits after SIGTERM: longer than a delivery plus the drain.
*/}}
{{- define "receipts.terminationGracePeriodSeconds" -}}
{{- $drain := add (.Values.config.deliveryTimeoutSeconds | ceil | int) (.Values.config.shutdownGraceSeconds | ceil | int) -}}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- add $drain 10 }}
{{- else }}
{{- .Values.worker.terminationGracePeriodSeconds | int }}
{{- end }}
{{- end }}

{{/*
Checks of value combinations; included by every workload template, renders nothing.
*/}}
{{- define "receipts.validate" -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- if gt (int $n.total) (int $n.budget) }}
{{- fail (printf "connection budget exceeded: %s. Lower autoscaling.maxReplicas (or worker.replicaCount) or config.poolMaxSize, set config.listenNotify=false or config.pgbouncer=true, or raise connectionBudget.maxConnections." (include "receipts.connectionsLine" .)) }}
{{- end }}
{{- $c := .Values.config -}}
{{- if gt (float64 $c.deliveryTimeoutSeconds) (float64 (sub ($c.leaseSeconds | int) ($c.leaseMarginSeconds | int))) }}
{{- fail (printf "config.deliveryTimeoutSeconds (%v) must be <= config.leaseSeconds (%v) - config.leaseMarginSeconds (%v): a delivery must end before its lease can expire." $c.deliveryTimeoutSeconds $c.leaseSeconds $c.leaseMarginSeconds) }}
{{- end }}
{{- $drain := add ($c.deliveryTimeoutSeconds | ceil | int) ($c.shutdownGraceSeconds | ceil | int) -}}
{{- if le (include "receipts.terminationGracePeriodSeconds" . | int) $drain }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) must exceed config.deliveryTimeoutSeconds + config.shutdownGraceSeconds (%d), or a draining worker is killed mid-delivery." .Values.worker.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (.Values.autoscaling.minReplicas | int) (.Values.autoscaling.maxReplicas | int) }}
{{- fail (printf "autoscaling.minReplicas (%v) must be <= autoscaling.maxReplicas (%v)." .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) }}
{{- end }}
{{- if and (eq (.Values.autoscaling.minReplicas | int) 0) (not .Values.autoscaling.keda.enabled) }}
{{- fail "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.keda.enabled=true; a plain HPA cannot scale to zero." }}
{{- end }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers of this service's series.
*/}}
{{- define "receipts.alertSelector" -}}
{{- default (printf "job=\"%s\"" (include "receipts.fullname" .)) .Values.alerts.selector }}
{{- end }}

{{/*
Writable /tmp (the root filesystem is read-only).
*/}}
{{- define "receipts.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}
